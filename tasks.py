"""Tasks: sample(n) -> prompts, rollout(policy, prompts, group_size) -> Batch, evaluate(policy) -> dict.

Invariant: training prompts and held-out prompts are disjoint by construction, and every member
of a group starts from the same prompt (the same initial state, for control).
"""
import numpy as np
import torch

from core import Batch, Trajectory

EVAL_SEED0 = 2**31  # held-out CartPole seeds are EVAL_SEED0 + i; training seeds are < 2**31


class CartPole:
    """CartPole-v1, numpy, vectorised: all episodes of a rollout step together with one policy
    forward per time step. Dynamics, thresholds, the 500-step truncation and the reset
    (np.random.default_rng(seed).uniform(-0.05, 0.05, 4)) match gymnasium's, step for step."""
    obs_dim, n_actions, max_len, metric, is_llm = 4, 2, 500, "eval_return", False
    gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    x_limit, theta_limit = 2.4, 12 * 2 * np.pi / 360

    def __init__(self, eval_episodes=16):
        self.eval_episodes = eval_episodes

    def sample(self, n, rng: np.random.Generator):
        return rng.integers(0, EVAL_SEED0, size=n).tolist()

    def reset(self, seeds):
        return np.stack([np.random.default_rng(s).uniform(-0.05, 0.05, 4) for s in seeds])  # [N, 4]

    def step(self, s, a):
        """Euler step of the Barto-Sutton-Anderson cart-pole. s [N, 4] float64, a [N] -> s' [N, 4]."""
        x, x_dot, th, th_dot = s.T
        total_mass, pml = self.masspole + self.masscart, self.masspole * self.length
        force = np.where(a == 1, self.force_mag, -self.force_mag)
        cos, sin = np.cos(th), np.sin(th)
        temp = (force + pml * th_dot**2 * sin) / total_mass
        th_acc = (self.gravity * sin - cos * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * cos**2 / total_mass))
        x_acc = temp - pml * th_acc * cos / total_mass
        return np.stack([x + self.tau * x_dot, x_dot + self.tau * x_acc,
                         th + self.tau * th_dot, th_dot + self.tau * th_acc], 1)

    def terminated(self, s):
        return (np.abs(s[:, 0]) > self.x_limit) | (np.abs(s[:, 2]) > self.theta_limit)  # [N]

    def rollout(self, policy, prompts, group_size, greedy=False):
        s = self.reset(np.repeat(prompts, group_size))                      # [N, 4], groups contiguous
        N = len(s)
        obs, acts, logps = [], [], []
        alive, length = np.ones(N, bool), np.zeros(N, np.int64)
        for _ in range(self.max_len):
            o = s.astype(np.float32)                                         # gymnasium's obs dtype
            a, lp = policy.act(o, greedy)
            obs.append(o), acts.append(a), logps.append(lp)
            s = np.where(alive[:, None], self.step(s, a), s)                 # finished rows stay put
            length += alive
            alive &= ~self.terminated(s)
            if not alive.any():
                break
        obs, acts, logps = (torch.from_numpy(np.stack(x, 1)) for x in (obs, acts, logps))  # [N, T, ...]
        final = torch.from_numpy(s.astype(np.float32))                      # [N, 4]
        rows = [Trajectory(states=obs[i, :L], actions=acts[i, :L], logp=logps[i, :L],
                           rewards=torch.ones(L), mask=torch.ones(L), truncated=bool(alive[i]),
                           final_state=final[i]) for i, L in enumerate(length.tolist())]
        return Batch.from_groups([rows[i:i + group_size] for i in range(0, N, group_size)])

    def evaluate(self, policy):
        """Greedy return on the held-out seeds, all episodes at once."""
        seeds = [EVAL_SEED0 + i for i in range(self.eval_episodes)]
        return {"eval_return": self.rollout(policy, seeds, 1, greedy=True).row_rewards().mean().item()}


TASKS = {"cartpole": CartPole}
