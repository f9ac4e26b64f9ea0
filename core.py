"""The data that flows: a Trajectory is one rollout, a Batch is their right-padded stack.

Invariant: padding is exactly 0 in every [N, T] field, and the rows of one group are contiguous,
so the group axis is a plain reshape [N] -> [n_prompts, G].

Shapes, used everywhere:  N = n_prompts * G rows, G = group_size, T = padded length,
O = observation size (control), V = vocabulary (LLM), mb = rows in a micro-batch.
Control row: states [T, O] float, actions [T], mask 1 on real steps, reward +1 per step.
LLM row: states = actions = all token ids (prompt + completion) [T]; logp[t] = log p(id_t | id_<t);
mask 1 on completion tokens (stop token included); the scalar reward sits on the last one. Tool replies
and user turns inserted in a completion (--max-tool-calls, --max-turns) are context: mask 0, logp 0."""
from dataclasses import dataclass, replace

import torch
from torch.nn.utils.rnn import pad_sequence


@dataclass
class Trajectory:
    states: torch.Tensor            # [T, O] observations, or [T] token ids
    actions: torch.Tensor           # [T] long
    logp: torch.Tensor              # [T] sampler's log-probs (0 where mask is 0)
    rewards: torch.Tensor           # [T]
    mask: torch.Tensor              # [T] 1 where the policy acted and is trained
    truncated: bool = False         # stopped by a budget, not by the task: bootstrap, don't terminate
    final_state: torch.Tensor | None = None  # [O] state after the last step (critic bootstrap)


@dataclass
class Batch:
    states: torch.Tensor            # [N, T, O] or [N, T]
    actions: torch.Tensor           # [N, T]
    logp: torch.Tensor              # [N, T] sampler's log-probs: logged against ours, never trained on
    rewards: torch.Tensor           # [N, T]
    mask: torch.Tensor              # [N, T] float
    truncated: torch.Tensor         # [N] bool
    final_states: torch.Tensor | None  # [N, O] or None
    group_size: int
    version: int = 0                # weights version that sampled this batch (async)
    lease: str = ""                 # the lease it was made for (async): its prompts' seed

    @staticmethod
    def from_rows(rows, group_size):
        """Rows in prompt-major order, each prompt's group_size rows contiguous -> their Batch."""
        assert len(rows) % group_size == 0, "every group needs the same size"
        pad = lambda field: pad_sequence([getattr(tr, field) for tr in rows], batch_first=True)
        final = [tr.final_state for tr in rows]
        return Batch(                                                      # states [N, T, O] or [N, T]
            **{field: pad(field) for field in ("states", "actions", "logp", "rewards")},  # zero right-padded
            mask=pad("mask").float(),                                      # [N, T]
            truncated=torch.tensor([tr.truncated for tr in rows]),         # [N]
            final_states=None if final[0] is None else torch.stack(final),  # [N, O]
            group_size=group_size)

    def __len__(self):
        return self.actions.shape[0]

    @property
    def n_prompts(self):
        return len(self) // self.group_size

    def _map(self, fn):
        """Apply fn to every tensor field (all of them are per-row), keep the rest."""
        return replace(self, **{name: fn(x) for name, x in vars(self).items() if torch.is_tensor(x)})

    def to(self, device):
        return self._map(lambda x: x.to(device))

    def __getitem__(self, rows):
        return self._map(lambda x: x[rows])

    def micro_batches(self, size):
        """Row slices of at most `size` rows (0: one slice). Slice the batch and its advantages alike."""
        size = size or len(self)
        return [slice(i, i + size) for i in range(0, len(self), size)]

    def grouped_rewards(self):
        return self.rewards.sum(1).view(self.n_prompts, self.group_size)    # [n_prompts, G]

    def equal_groups(self):
        """[n_prompts] bool: groups whose rewards are all equal (exactly 0 advantage: nothing to compare)."""
        R = self.grouped_rewards()                                           # [n_prompts, G]
        return (R == R[:, :1]).all(1)

    def insertions(self):
        """Tool replies and user turns inserted in each row: the runs of 0s between runs of 1s in its mask."""
        starts = self.mask.diff(prepend=torch.zeros_like(self.mask[:, :1])) > 0       # [N, T] a run begins
        return starts.sum(1) - 1                                                      # [N]

    def turns(self, eos):
        """[N] the model's turns in each (LLM) row: its end-of-turn ids trained, the inserted ones that end a
        turn cut at --max-turn-tokens (first in a user turn, not after a trained one), + 1 if cut mid-turn."""
        is_eos = torch.isin(self.states, torch.tensor(eos, device=self.states.device))  # [N, T]
        after_eos = torch.cat([torch.zeros_like(is_eos[:, :1]), is_eos[:, :-1]], 1)    # [N, T]
        trained_later = self.mask.flip(1).cumsum(1).flip(1) > 0                      # [N, T] not the padding
        capped = (self.mask.diff(prepend=self.mask[:, :1]) < 0) & is_eos & ~after_eos & trained_later
        last = self.mask.shape[1] - 1 - self.mask.flip(1).argmax(1)                   # [N] last trained
        return (is_eos * self.mask).sum(1) + capped.sum(1) + (~is_eos.gather(1, last[:, None])[:, 0]).float()
