"""Policies: MLPPolicy for control tasks (HFPolicy and VLLMGenerator for LLMs come with the LLM path).

Protocol: act(...) samples without grad and returns the sampler's log-probs; logprobs(batch) ->
([N, T] log-probs under the current parameters, with grad; [N, T] entropy or None); value(states)
-> [N, T] or None. param_groups() -> {"actor": [...], "critic": [...]}, clipped separately.
"""
import copy

import numpy as np
import torch
import torch.nn as nn


def mlp(n_in, hidden, n_out):
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, n_out))


class MLPPolicy(nn.Module):
    """Categorical policy over n_actions; a separate critic trunk only when the algorithm needs one
    (sharing a trunk would let the critic's gradients move the policy)."""

    def __init__(self, obs_dim, n_actions, hidden=64, critic=False, reference=False):
        super().__init__()
        self.actor = mlp(obs_dim, hidden, n_actions)
        self.critic = mlp(obs_dim, hidden, 1) if critic else None
        # KL reference: a frozen copy of the initial actor (a few KB for an MLP)
        self.ref = copy.deepcopy(self.actor).requires_grad_(False) if reference else None

    @torch.no_grad()
    def act(self, obs: np.ndarray, greedy=False):
        """obs [N, O] -> actions [N] int64, sampler log-probs [N] float32 (numpy, for the env)."""
        logp = torch.log_softmax(self.actor(torch.from_numpy(obs)), -1)      # [N, A]
        a = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1)[:, 0]  # [N]
        return a.numpy(), logp.gather(1, a[:, None])[:, 0].numpy()

    def logprobs(self, batch, entropy=False):
        logp_all = torch.log_softmax(self.actor(batch.states), -1)           # [N, T, A]
        logp = logp_all.gather(2, batch.actions[..., None])[..., 0]          # [N, T]
        ent = -(logp_all.exp() * logp_all).sum(-1) if entropy else None      # [N, T]
        return logp, ent

    @torch.no_grad()
    def ref_logprobs(self, batch):
        logp_all = torch.log_softmax(self.ref(batch.states), -1)             # [N, T, A]
        return logp_all.gather(2, batch.actions[..., None])[..., 0]          # [N, T]

    def value(self, states):
        return None if self.critic is None else self.critic(states)[..., 0]  # [N, T]

    def param_groups(self):
        groups = {"actor": list(self.actor.parameters())}
        if self.critic is not None:
            groups["critic"] = list(self.critic.parameters())
        return groups
