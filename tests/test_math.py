"""Hand-computed values for the math every algorithm stands on; the arithmetic is in the comments."""
import math

import pytest
import torch

from algos import grpo, reinforce, rloo
from core import Batch, Trajectory
from train import aggregate, policy_loss
from utils import discounted_returns, gae, masked_sum, whiten

T = torch.tensor


def test_discounted_returns_terminated_truncated_padded():
    r, m = T([[1.0, 1, 1]]), T([[1.0, 1, 1]])
    # gamma 0.5, terminated: G2 = 1, G1 = 1 + .5*1 = 1.5, G0 = 1 + .5*1.5 = 1.75
    assert discounted_returns(r, m, 0.5).tolist() == [[1.75, 1.5, 1.0]]
    # truncated, bootstrap V = 4: G2 = 1 + .5*4 = 3, G1 = 1 + .5*3 = 2.5, G0 = 1 + .5*2.5 = 2.25
    assert discounted_returns(r, m, 0.5, bootstrap=T([4.0])).tolist() == [[2.25, 2.5, 3.0]]
    # padding stays 0 and the bootstrap applies after the row's last real step
    r, m = T([[1.0, 1, 0]]), T([[1.0, 1, 0]])
    assert discounted_returns(r, m, 0.5).tolist() == [[1.5, 1.0, 0.0]]
    assert discounted_returns(r, m, 0.5, bootstrap=T([4.0])).tolist() == [[2.5, 3.0, 0.0]]
    # an LLM row: prompt tokens masked, reward 2 on the last token, gamma 1 -> 2 on every completion token
    assert discounted_returns(T([[0.0, 0, 0, 2]]), T([[0.0, 0, 1, 1]]), 1.0).tolist() == [[0, 0, 2, 2]]


def test_gae_terminated_truncated_padded():
    r, v, m = T([[1.0, 1]]), T([[0.5, 1.0]]), T([[1.0, 1]])
    # gamma = lam = .5, terminated: d1 = 1 + 0 - 1 = 0 -> A1 = 0; d0 = 1 + .5*1 - .5 = 1 -> A0 = 1 + .25*0 = 1
    assert gae(r, v, m, 0.5, 0.5).tolist() == [[1.0, 0.0]]
    # truncated, V(final) = 2: d1 = 1 + .5*2 - 1 = 1 -> A1 = 1; A0 = d0 + .25*A1 = 1.25
    assert gae(r, v, m, 0.5, 0.5, bootstrap=T([2.0])).tolist() == [[1.25, 1.0]]
    # lam = 1 is Monte-Carlo: returns(boot 2) = [2, 2], minus V = [1.5, 1.0]
    assert gae(r, v, m, 0.5, 1.0, bootstrap=T([2.0])).tolist() == [[1.5, 1.0]]
    # garbage values in padding never leak: same as the unpadded row, 0 in padding
    got = gae(T([[1.0, 1, 0]]), T([[0.5, 1.0, 9.0]]), T([[1.0, 1, 0]]), 0.5, 0.5)
    assert got.tolist() == [[1.0, 0.0, 0.0]]


def test_whiten_and_masked_sum():
    x, m = T([[1.0, 2, 3, 100]]), T([[1.0, 1, 1, 0]])
    # mean 2, population var (1 + 0 + 1) / 3 = 2/3, std .8165 -> [-1.2247, 0, 1.2247], padding 0
    w = whiten(x, m)
    assert torch.allclose(w, T([[-1.0, 0, 1, 0]]) * math.sqrt(1.5), atol=1e-6) and w[0, 3] == 0
    assert masked_sum(x, m).item() == 6.0                                # 100 is padding
    assert whiten(x, torch.zeros_like(m)).tolist() == [[0.0] * 4]        # empty mask: 0, not NaN


def llm_batch(rewards, G):
    """Rows shaped like LLM rows: 1 prompt token (mask 0), 2 completion tokens, reward on the last."""
    rows = [Trajectory(states=torch.zeros(3, dtype=torch.long), actions=torch.zeros(3, dtype=torch.long),
                       logp=torch.zeros(3), rewards=T([0.0, 0, r]), mask=T([0.0, 1, 1])) for r in rewards]
    return Batch.from_rows(rows, G)


def test_grpo_dr_grpo_rloo_and_uniform_groups():
    b = llm_batch([1, 0, 0, 1, 2, 2, 2, 2], G=4)
    # group 0: mean .5, unbiased std sqrt(4 * .25 / 3) = .57735 -> A = +-.5/.57735 = +-.866025
    # group 1: all rewards equal -> exactly 0 (not a rounding residue)
    adv, target = grpo(b, None, std_norm=True)
    assert target is None and adv.shape == (8, 3)
    assert torch.allclose(adv[:4, 2], T([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-5)
    assert (adv[4:] == 0).all() and (adv[:, 0] == 0).all()               # prompt tokens carry nothing
    assert (adv[:, 1] == adv[:, 2]).all()                                # one scalar per completion
    # Dr. GRPO: no std division -> R - mean = [.5, -.5, -.5, .5]
    assert grpo(b, None, std_norm=False)[0][:4, 2].tolist() == [0.5, -0.5, -0.5, 0.5]
    # RLOO: A0 = 1 - mean(0, 0, 1) = 2/3, A1 = 0 - mean(1, 0, 1) = -2/3
    assert torch.allclose(rloo(b, None)[0][:4, 2], T([2, -2, -2, 2]) / 3)
    assert (rloo(b, None)[0][4:] == 0).all()
    # an unlucky float group still gives exactly 0: .1 * 3 / 3 != .1 in floating point
    assert (grpo(llm_batch([0.1] * 3, G=3), None, std_norm=True)[0] == 0).all()
    # REINFORCE on LLM rows: the return-to-go is the reward on every completion token
    assert reinforce(b, None, gamma=1.0)[0][0].tolist() == [0.0, 1.0, 1.0]


def test_group_estimators_refuse_groups_of_one():
    with pytest.raises(ValueError, match="--group-size"):
        grpo(llm_batch([1, 0], G=1), None, std_norm=True)
    with pytest.raises(ValueError, match="--group-size"):
        rloo(llm_batch([1, 0], G=1), None)


def test_loss_aggregation_modes():
    mask = T([[1.0, 1, 0], [1.0, 0, 0]])
    adv = T([[1.0, 2, 0], [4.0, 0, 0]])
    logp = torch.zeros(2, 3)
    loss = lambda agg, denom: policy_loss(logp, logp, adv, mask, 0.2, 0.2, agg, denom)[0].item()
    assert loss("token", 3) == pytest.approx(-7 / 3)                # -(1 + 2 + 4) / 3 tokens
    assert loss("seq", 2) == pytest.approx(-2.75)                   # -((1 + 2) / 2 + 4 / 1) / 2 rows
    assert loss("constant", 2 * 4) == pytest.approx(-0.875)        # -(1 + 2 + 4) / (2 rows * 4 max len)
    # two micro-batches with the global denominator add up to the whole batch
    for agg, d in (("token", 3), ("seq", 2), ("constant", 8)):
        parts = sum(aggregate(-adv[i:i + 1], mask[i:i + 1], agg, d).item() for i in range(2))
        assert parts == pytest.approx(loss(agg, d))


def test_clipped_surrogate():
    one = torch.ones(1, 1)
    new = torch.full((1, 1), math.log(1.5), requires_grad=True)         # ratio 1.5
    # A = +1: min(1.5, clip(1.5) = 1.2) = 1.2 -> loss -1.2, and the clipped term has no gradient
    loss, ratio = policy_loss(new, torch.zeros(1, 1), one, one, 0.2, 0.2, "token", 1)
    loss.backward()
    assert loss.item() == pytest.approx(-1.2) and ratio.item() == pytest.approx(1.5) and new.grad.item() == 0
    # A = -1: min(-1.5, -1.2) = -1.5 -> loss 1.5, unclipped: the pessimistic side always keeps its gradient
    new.grad = None
    loss, _ = policy_loss(new, torch.zeros(1, 1), -one, one, 0.2, 0.2, "token", 1)
    loss.backward()
    assert loss.item() == pytest.approx(1.5) and new.grad.item() == pytest.approx(1.5)
    # clip-higher: eps_high .6 lets ratio 1.5 through: loss -1.5
    assert policy_loss(new, torch.zeros(1, 1), one, one, 0.2, 0.6, "token", 1)[0].item() == pytest.approx(-1.5)
