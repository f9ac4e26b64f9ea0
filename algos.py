"""Advantage estimators: the only thing REINFORCE, PPO, GRPO, RLOO and on-policy distillation disagree on.

Every estimator is `(batch, policy, **hyper-parameters) -> (adv [N, T], critic_target [N, T] | None)`,
pure (writes nothing onto the batch), zero where batch.mask is zero; hyper-parameters bind by Config name.
A teacher's per-token grade, distill(), is added in update(), from the log-probs of its own forward."""
import math

import torch

from utils import discounted_returns, gae, whiten


def reinforce(batch, policy, gamma):
    """A_t = G_t = sum_k gamma^k r_{t+k}, the return-to-go (Williams 1992; no baseline)."""
    return discounted_returns(batch.rewards, batch.mask, gamma), None


def reinforce_baseline(batch, policy, gamma):
    """A_t = (G_t - mean G) / std G over all masked steps of the batch: a constant baseline, whitened."""
    return whiten(discounted_returns(batch.rewards, batch.mask, gamma), batch.mask), None


@torch.no_grad()
def ppo(batch, policy, gamma, lam):
    """A = whiten(GAE(gamma, lam)) under the critic that sampled; critic target = GAE + V, computed
    once here (no value clipping). Truncated rows bootstrap from V(final state)."""
    values = policy.value(batch.states)                                      # [N, T]
    boot = policy.value(batch.final_states[:, None])[:, 0] * batch.truncated  # [N]
    adv = gae(batch.rewards, values, batch.mask, gamma, lam, boot)            # [N, T]
    return whiten(adv, batch.mask), (adv + values) * batch.mask


def _grouped_rewards(batch):
    if batch.group_size < 2:
        raise ValueError("group baselines need --group-size >= 2 (a group of one is its own "
                         "baseline, so every advantage would be 0): use --group-size 8")
    return batch.grouped_rewards()                                           # [n_prompts, G]


def _per_token(A, batch):
    """[n_prompts, G] sequence advantages -> [N, T], broadcast over each row's masked steps.
    A group whose rewards are all equal gets exactly 0 (not a float residue of mean - x)."""
    A = torch.where(batch.equal_groups()[:, None], 0.0, A)
    return A.reshape(-1, 1) * batch.mask                                     # [N, T]


def grpo(batch, policy, std_norm):
    """A_i = (R_i - mean R_group) / (std R_group + 1e-6), std unbiased (Shao et al. 2024).
    std_norm=False is Dr. GRPO's estimator (Liu et al. 2025): A_i = R_i - mean R_group."""
    R = _grouped_rewards(batch)                                              # [n_prompts, G]
    A = R - R.mean(1, keepdim=True)
    if std_norm:
        A /= R.std(1, keepdim=True) + 1e-6
    return _per_token(A, batch), None


def rloo(batch, policy):
    """A_i = R_i - mean of the other G-1 rewards of its group (Ahmadian et al. 2024)."""
    R, G = _grouped_rewards(batch), batch.group_size                        # [n_prompts, G]
    return _per_token(R - (R.sum(1, keepdim=True) - R) / (G - 1), batch), None


def opd(batch, policy):
    """On-policy distillation (Agarwal et al. 2024) alone: no reward term. The advantage is the teacher's
    grade of each token, distill() with weight 1, unclipped, added in update()."""
    return torch.zeros_like(batch.mask), None                                # [N, T]


def distill(logp_teacher, logp_student, mask, coef=1.0, clip=math.inf):
    """A frozen teacher grades each sampled token, a one-sample reverse KL, negated: [mb, T] each ->
        A_t = coef * clip(sg[log pi_teacher(y_t | y_<t) - log pi_student(y_t | y_<t)], -clip, clip).
    Beside a reward estimator's ~unit advantage, constant over a row (--distill-coef C), clip = 1 nat: else
    one token the teacher finds unlikely (-15) outweighs the row's reward at C = 1; so C bounds its say."""
    return coef * (logp_teacher - logp_student).clamp(-clip, clip) * mask


# the three registries train.py reads: a new algorithm is its function here, named as its --algo, and that
# name in GROUP_ESTIMATORS if it compares a group's samples, in NEEDS_CRITIC if it needs a value head
ESTIMATORS = {f.__name__: f for f in (reinforce, reinforce_baseline, ppo, grpo, rloo, opd)}
GROUP_ESTIMATORS = {"grpo", "rloo"}   # need --group-size >= 2; with opd, the only ones --max-tool-calls takes
NEEDS_CRITIC = {"ppo"}                # get a critic (MLPPolicy's second trunk); refused for LLM tasks
