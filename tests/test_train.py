"""The update's invariants, the loop's behaviour (solves, resumes exactly), and every bad input."""
import copy
import json
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import algos
from model import MLPPolicy
from tasks import CartPole
from train import Config, parse_config, read_yaml, set_weights, train, trainable, update, validate
from utils import Adam

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup(algo="ppo", seed=0, **kw):
    torch.manual_seed(seed)
    cfg = Config(algo=algo, group_size=2, max_grad_norm=0.0, **kw)
    task = CartPole()
    policy = MLPPolicy(4, 2, 16, critic=algo == "ppo", reference=cfg.kl_coef > 0)
    batch = task.rollout(policy, [11, 12, 13], group_size=2)                # N = 6 rows of uneven length
    fn = algos.ESTIMATORS[algo]
    hp = {"ppo": dict(gamma=0.99, lam=0.95), "grpo": dict(std_norm=True)}.get(algo, dict(gamma=0.99))
    adv, target = fn(batch, policy, **hp)
    return cfg, task, policy, batch, adv, target


def grads_after(policy, cfg, batch, adv, target, max_len=500, snapshot=None):
    policy = copy.deepcopy(policy)
    opt = Adam(list(policy.param_groups().values()), lr=cfg.lr)
    stats, _ = update(policy, opt, batch, adv, target, cfg, max_len, snapshot)
    return [p.grad.clone() for p in policy.parameters() if p.grad is not None], stats


def test_ratio_is_exactly_one_on_the_first_epoch_and_moves_after():
    cfg, task, policy, batch, adv, target = setup("ppo", ent_coef=0.01)
    _, stats = grads_after(policy, cfg, batch, adv, target)
    assert stats["ratio"] == 1.0 and stats["clip_frac"] == 0.0 and stats["logp_gap"] < 1e-6
    cfg.inner_epochs = 3
    _, stats = grads_after(policy, cfg, batch, adv, target)
    assert stats["ratio"] != 1.0                                          # epoch 3 sees moved weights


def test_a_stale_batch_weighs_each_sample_by_pi_now_over_pi_then_at_most_1_and_clips_around_now():
    """Async: a batch sampled by older weights (the snapshot `then`). Its gradient is the on-policy one with
    each advantage times min(1, pi_now / pi_then), and the ratio is taken against the weights before this
    update (1 on the first epoch, as in sync): clipping against pi_then cut ~70% of CartPole's gradient."""
    cfg, task, policy, batch, adv, target = setup("reinforce")
    torch.manual_seed(1)
    snapshot = {n: p.detach() + 0.3 * torch.randn_like(p) for n, p in trainable(policy).items()}
    now = policy.logprobs(batch)[0].detach()                             # [N, T]
    then = copy.deepcopy(policy)
    set_weights(then, snapshot)
    then = then.logprobs(batch)[0].detach()
    assert ((now > then) & (batch.mask > 0)).any() and ((now < then) & (batch.mask > 0)).any()
    stale, stats = grads_after(policy, cfg, batch, adv, target, snapshot=snapshot)
    weighted, _ = grads_after(policy, cfg, batch, adv * torch.exp(now - then).clamp(max=1), target)
    assert stats["ratio"] == 1.0 and stats["clip_frac"] == 0.0
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(stale, weighted))
    assert not all(torch.allclose(a, b, atol=1e-3) for a, b in zip(stale, grads_after(policy, cfg, batch, adv, target)[0]))


class TwoActions(torch.nn.Module):
    """A policy of one row of logits theta over 2 actions, the same at every step (states unused): small enough
    to work its update out by hand."""

    def __init__(self):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.zeros(2))

    def logprobs(self, batch, entropy=False, entropy_grad=False):
        logp = torch.log_softmax(self.theta, 0)[batch.actions]                         # [N, T]
        return logp, torch.zeros_like(logp)

    def param_groups(self):
        return {"actor": [self.theta]}


def test_a_stale_batch_over_two_epochs_gives_the_hand_computed_loss():
    """Async, stale, --inner-epochs 2, where the clip's centre matters. One row, actions [0, 1], A = [+1, -1];
    theta = 0, so pi_prox = [0.5, 0.5]; the snapshot's theta = log [0.25, 0.75], so pi_behav = [0.25, 0.75].
    Epoch 0: A' = A min(1, pi_prox / pi_behav) = [1 min(1, 2), -1 min(1, 2/3)] = [1, -2/3]; r = 1; grad of
    -(A'_0 log pi(0) + A'_1 log pi(1)) / 2 = -([.5, -.5] + 2/3 [-.5, .5]) / 2 = [-5/12, 5/12]. Adam's first
    step moves theta by lr * sign(grad) = 0.5: theta = [.5, -.5], pi = [sigmoid(1), sigmoid(-1)] = [.731, .269].
    Epoch 1: r = pi / pi_prox = [1.4621, 0.5379]; clipped to [0.8, 1.2]: min(1.4621 x 1, 1.2 x 1) = 1.2 and
    min(0.5379 x -2/3, 0.8 x -2/3) = -0.5333, so loss = -(1.2 - 0.5333) / 2 = -1/3.
    (Centred on pi_behav the ratio would be pi / pi_behav; untruncated, A'_0 = 2 and the loss -0.9333.)"""
    from core import Batch, Trajectory
    row = Trajectory(states=torch.zeros(2), actions=torch.tensor([0, 1]), logp=torch.zeros(2),
                     rewards=torch.zeros(2), mask=torch.ones(2))
    batch = Batch.from_rows([row], 1)
    policy = TwoActions()
    cfg = Config(inner_epochs=2, clip_eps=0.2, loss_agg="token", max_grad_norm=0.0, lr=0.5)
    snapshot = {"theta": torch.tensor([0.25, 0.75]).log()}
    stats, _ = update(policy, Adam([[policy.theta]], lr=0.5), batch, torch.tensor([[1.0, -1.0]]), None, cfg, 2,
                      snapshot)
    assert stats["loss"] == pytest.approx(-1 / 3, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(1.0)                                    # both tokens clipped


@pytest.mark.parametrize("agg", ["token", "seq", "constant"])
@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_micro_batched_gradient_equals_one_big_backward(algo, agg):
    cfg, task, policy, batch, adv, target = setup(algo, loss_agg=agg, kl_coef=0.1, ent_coef=0.01)
    big, _ = grads_after(policy, cfg, batch, adv, target)
    cfg.micro_batch = 4                                                   # slices of 4 and 2 rows
    small, _ = grads_after(policy, cfg, batch, adv, target)
    assert len(big) == len(small) > 0
    for a, b in zip(big, small):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), (a - b).abs().max()
    assert any(g.abs().sum() > 0 for g in big)                            # a real, non-zero gradient


def test_non_finite_gradient_skips_the_update_and_keeps_weights():
    cfg, task, policy, batch, adv, target = setup("reinforce")
    adv = adv.clone()
    adv[0, 0] = float("nan")
    before = copy.deepcopy(policy.state_dict())
    opt = Adam(list(policy.param_groups().values()), lr=0.1)
    stats, _ = update(policy, opt, batch, adv, target, cfg, 500)
    assert stats["skipped"] == 1 and opt.t == 0
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())


def rows_forwarded(policy, monkeypatch):
    """A list that this policy's logprobs appends each forward's row count to (the real forward runs)."""
    seen, forward = [], policy.logprobs
    monkeypatch.setattr(policy, "logprobs", lambda batch, **kw: seen.append(len(batch)) or forward(batch, **kw))
    return seen


def counted_update(policy, cfg, batch, adv, target, monkeypatch, opt=None):
    """update() on this policy -> (its gradients, stats, the rows of each forward)."""
    seen = rows_forwarded(policy, monkeypatch)
    stats, _ = update(policy, opt or Adam(list(policy.param_groups().values()), lr=0.1), batch, adv, target, cfg, 500)
    return [p.grad.clone() for p in policy.parameters() if p.grad is not None], stats, seen


@pytest.mark.parametrize("agg", ["token", "seq", "constant"])
def test_rows_of_advantage_zero_are_not_computed_and_the_gradient_is_the_same(agg, monkeypatch):
    """GRPO, micro-batches of 4: the first two groups' rows (an equal-reward group's advantage, 0 everywhere)
    are never forwarded, the denominators still count them, so the gradient is every row's to rounding."""
    cfg, task, policy, batch, adv, target = setup("grpo", loss_agg=agg, micro_batch=4)
    adv = adv.clone()
    adv[:4] = 0                                                          # groups 0 and 1: no signal
    assert adv[4:].ne(0).any(1).all()
    every, every_stats, every_seen = counted_update(copy.deepcopy(policy), replace(cfg, every_row=True), batch, adv,
                                                    target, monkeypatch)
    some, stats, seen = counted_update(copy.deepcopy(policy), cfg, batch, adv, target, monkeypatch)
    assert every_seen == [4, 2] and seen == [2]                          # the third group's rows, only
    assert every_stats["rows_trained"] == 6 and stats["rows_trained"] == 2
    assert len(every) == len(some) > 0 and any(g.abs().sum() > 0 for g in every)
    for a, b in zip(every, some):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-5), (a - b).abs().max()
    assert stats["loss"] == pytest.approx(every_stats["loss"], rel=1e-5)


def test_a_batch_without_signal_forwards_nothing_and_adam_steps_as_on_a_zero_gradient(monkeypatch):
    """Every row of advantage 0: no forward, and the optimizer steps as it does on the zero gradient that every
    row would give (Adam's moments carry the last step on: a zero gradient still moves the weights), so the
    weights after a signal step then a dead one are the same as when every row is computed."""
    cfg, task, policy, batch, adv, target = setup("grpo")
    ends = []
    for every_row in (True, False):
        p = copy.deepcopy(policy)
        opt = Adam(list(p.param_groups().values()), lr=0.1)
        c = replace(cfg, every_row=every_row)
        update(p, opt, batch, adv, target, c, 500)                       # a step with signal
        _, stats, seen = counted_update(p, c, batch, torch.zeros_like(adv), target, monkeypatch, opt)
        assert seen == ([6] if every_row else []) and stats["rows_trained"] == (6 if every_row else 0)
        assert opt.t == 2 and stats["skipped"] == 0 and stats["grad_norm"] == 0
        ends.append(p.state_dict())
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])
    assert not torch.equal(ends[0]["actor.0.weight"], policy.state_dict()["actor.0.weight"])


def test_kl_against_the_reference_is_zero_before_any_update():
    cfg, task, policy, batch, adv, target = setup("reinforce", kl_coef=0.5)
    _, stats = grads_after(policy, cfg, batch, adv, target)
    assert stats["kl"] == 0.0


def quick(tmp_path, name, **kw):
    return Config(**{"out": str(tmp_path / name), "eval_every": 0, "solve_at": 0.0, "n_prompts": 4, **kw})


def test_resume_equals_an_uninterrupted_run(tmp_path):
    for algo, extra in (("ppo", dict(inner_epochs=2)), ("grpo", dict(group_size=2))):
        train(quick(tmp_path, f"full-{algo}", steps=6, algo=algo, **extra))
        train(quick(tmp_path, f"part-{algo}", steps=3, algo=algo, **extra))
        train(quick(tmp_path, f"part-{algo}", steps=6, algo=algo, resume=str(tmp_path / f"part-{algo}.pt"), **extra))
        a, b = (torch.load(tmp_path / f"{n}-{algo}.pt") for n in ("full", "part"))
        assert a["step"] == b["step"] == 6 and a["env_steps"] == b["env_steps"]
        assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"])
        assert all(torch.equal(x, y) for x, y in zip(a["optimizer"]["m"], b["optimizer"]["m"]))
        rows = (tmp_path / f"part-{algo}.csv").read_text().splitlines()
        assert len(rows) == 1 + 6 and rows[-1].startswith("6,")             # header + one row per step


def test_default_run_solves_cartpole(tmp_path):
    row = train(Config(out=str(tmp_path / "run")))
    assert row["eval_return"] == 500.0
    assert (tmp_path / "run.pt").exists() and (tmp_path / "run.csv").exists()


def test_csv_has_the_documented_columns(tmp_path):
    train(quick(tmp_path, "c", steps=2, eval_every=1))
    header = (tmp_path / "c.csv").read_text().splitlines()[0].split(",")
    for col in ["step", "reward", "eval_return", "loss", "pg_loss", "ratio", "clip_frac", "kl", "entropy",
                "grad_norm", "step_s", "env_steps", "skipped"]:
        assert col in header


BAD = [
    (dict(algo="grpo", group_size=1), "--algo grpo needs --group-size >= 2"),
    (dict(algo="rloo"), "--algo rloo needs --group-size >= 2"),
    (dict(model="gpt2"), "cartpole trains an MLP: drop them"),
    (dict(max_tool_calls=2), "--max-tool-calls, --max-turns are for LLMs; cartpole trains an MLP"),
    (dict(max_tool_calls=2, algo="reinforce"), "--max-tool-calls and --max-turns need --algo grpo, rloo or opd: reinforce's"),
    (dict(max_turns=3), "--max-tool-calls, --max-turns are for LLMs; cartpole trains an MLP"),
    (dict(max_turns=3, algo="reinforce_baseline"), "--max-turns need --algo grpo, rloo or opd: reinforce_baseline's"),
    (dict(max_turns=0), "--max-turns must be >= 1"),
    (dict(inner_epochs=0), "--inner-epochs must be >= 1"),
    (dict(micro_batch=-1), "--micro-batch must be >= 0"),
    (dict(resume="/nonexistent/x.pt"), "--resume /nonexistent/x.pt: no such file"),
]


@pytest.mark.parametrize("kw,msg", BAD, ids=[m for _, m in BAD])
def test_bad_config_names_the_fix(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("+", r"\+")):
        validate(Config(**kw))


@pytest.mark.parametrize("flag,value,valid", [("--algo", "a2c", "grpo"), ("--task", "pong", "cartpole"),
                                              ("--loss-agg", "mean", "seq"), ("--role", "trainr", "trainer"),
                                              ("--dtype", "float64", "bfloat16")])
def test_an_unknown_choice_names_the_choices(flag, value, valid, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=f"argument {flag}: invalid choice: '{value}' \\(choose from '"):
        parse_config([flag, value])
    name = flag[2:].replace('-', '_')
    (tmp_path / "p.yaml").write_text(f"{name}: {value}\n")                           # a preset is checked alike
    with pytest.raises(ValueError, match=f"argument {flag}: invalid choice: '{value}'"):
        parse_config(["--config", str(tmp_path / "p.yaml")])
    # and a Config built in code: --role trainr with a token once trained sync, silently
    monkeypatch.setenv("NANORL_TOKEN", "t")
    with pytest.raises(ValueError, match=f"^{flag} {value}: choose from .*{valid}") as e:
        validate(Config(**{name: value}))
    assert "\n" not in str(e.value)                                                   # that error alone


def test_n_prompts_must_split_over_ranks():
    with pytest.raises(ValueError, match="--n-prompts 3 must be a positive multiple of the 2 ranks: use --n-prompts 2"):
        validate(Config(n_prompts=3), world=2)


def test_corrupt_or_mismatched_checkpoint(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="not a readable NanoRL checkpoint"):
        train(quick(tmp_path, "x", steps=1, resume=str(bad)))
    train(quick(tmp_path, "ok", steps=1))
    with pytest.raises(ValueError, match="--lr 0.01 vs 0.02"):
        train(quick(tmp_path, "ok", steps=2, lr=0.02, resume=str(tmp_path / "ok.pt")))


def test_yaml_presets_and_flags(tmp_path):
    y = tmp_path / "p.yaml"
    y.write_text("algo: grpo\ngroup_size: 4\nlr: 1e-3\nstd_norm: false\n")
    cfg = parse_config(["--config", str(y), "--group-size", "8"])
    assert (cfg.algo, cfg.group_size, cfg.lr, cfg.std_norm) == ("grpo", 8, 0.001, False)  # flags win
    assert parse_config(["--no-std-norm"]).std_norm is False
    y.write_text("algo: grpo\ngroup_sise: 4\n")
    with pytest.raises(ValueError, match=r"unknown: \['group_sise'\]"):
        read_yaml(str(y))
    # a value of the wrong type names the file and the key (argparse's message named only --lr)
    for line, why in [("lr: abc", "lr: 'abc' is not of type float"), ("steps: ten", "steps: 'ten' is not of type int"),
                      ("steps: 2.5", "steps: 2.5 is not of type int"), ("lora: 1", "lora: 1 is not of type bool"),
                      ("model: [a, b]", "model: ['a', 'b'] is not of type str"), ("lr:", "lr: None is not of type")]:
        y.write_text(line + "\n")
        with pytest.raises(ValueError, match=rf"^{re.escape(str(y))}: {re.escape(why)}"):
            parse_config(["--config", str(y)])


def test_cli_prints_the_error_not_a_traceback(tmp_path):
    """... and writes it to torchrun's error file too, so that torchrun's summary names it (under torchrun:
    test_cli's test_torchrun_prints_a_user_error_once_and_names_it_in_its_summary, slow)."""
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")}
    p = subprocess.run([sys.executable, "train.py", "--algo", "grpo"], cwd=ROOT, capture_output=True, text=True,
                       env=env)
    assert p.returncode == 1 and p.stderr.startswith("error: --algo grpo needs --group-size >= 2")
    assert "Traceback" not in p.stderr
    assert json.loads((tmp_path / "error.json").read_text())["message"] == p.stderr.strip()


def test_our_adam_equals_torch_adam():
    """utils.Adam exists only to skip torch.optim's 1.3 s import of torch._dynamo: it must be Adam exactly."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    a, b = Adam([ours[:1], ours[1:]], lr=0.01), torch.optim.Adam(ref, lr=0.01, foreach=False)
    for _ in range(5):
        for p, q in zip(ours, ref):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    assert all(torch.allclose(p, q, atol=1e-7, rtol=0) for p, q in zip(ours, ref))
