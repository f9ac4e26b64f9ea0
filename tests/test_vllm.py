"""VLLMGenerator without vLLM: vLLM needs CUDA and these CPU machines have none, so its outputs are
played by stand-ins and the conversion (vllm_samples) is checked against HFPolicy.act's contract and
through the real task rollout. The LoRA-rank check and the missing-vLLM error run for real."""
import importlib.util
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from model import VLLMGenerator, vllm_samples
from tasks import MaxDigit

EOS = 1                                              # the stand-in vocabulary: 0 pad, 1 EOS, then characters
CHARS = "0123456789="


@dataclass
class FakeLogprob:
    """Stands in for vllm.logprobs.Logprob (vLLM cannot run on these CPU machines)."""
    logprob: float
    rank: int = 1


@dataclass
class FakeCompletionOutput:
    """Stands in for vllm.outputs.CompletionOutput: one of the n samples of a prompt."""
    index: int
    token_ids: list
    logprobs: list                                   # per position {token id: FakeLogprob}
    finish_reason: str                               # "stop" | "length"
    stop_reason: int | None = None


@dataclass
class FakeRequestOutput:
    """Stands in for vllm.outputs.RequestOutput: one prompt and its n samples, together."""
    prompt_token_ids: list
    outputs: list


def completion(i, ids, logps, finish, stop_reason=None):
    """Positions as vLLM returns them for logprobs=0: {sampled token: Logprob}, plus the top-1 token when
    the draw was not the argmax (here token 7 plays such a draw, next to a top-1 token 99)."""
    pos = [{t: FakeLogprob(lp, rank=2), 99: FakeLogprob(-0.01)} if t == 7 else {t: FakeLogprob(lp)}
           for t, lp in zip(ids, logps)]
    return FakeCompletionOutput(i, ids, pos, finish, stop_reason)


def test_prompt_major_logprobs_stop_token_and_truncation():
    outputs = [FakeRequestOutput([5, 12], [completion(0, [3, EOS], [-0.5, -0.25], "stop", EOS),
                                           completion(1, [7, 8, 9], [-1.0, -2.0, -3.0], "length")]),
               FakeRequestOutput([6, 12], [completion(0, [4, EOS], [-0.75, -0.125], "length"),  # EOS drawn last
                                           completion(1, [EOS], [-4.0], "stop")])]
    samples = vllm_samples(outputs, [EOS])
    assert [c.tolist() for c, _, _ in samples] == [[3, EOS], [7, 8, 9], [4, EOS], [EOS]]  # prompt-major, EOS kept once
    assert [lp.tolist() for _, lp, _ in samples] == [[-0.5, -0.25], [-1.0, -2.0, -3.0], [-0.75, -0.125], [-4.0]]
    assert [tr for _, _, tr in samples] == [False, True, False, False]   # stopped on EOS is never truncated
    assert all(c.dtype == torch.long and lp.dtype == torch.float32 for c, lp, _ in samples)


def test_a_finish_that_is_neither_eos_nor_length_is_refused():
    with pytest.raises(AssertionError, match="abort"):
        vllm_samples([FakeRequestOutput([5], [completion(0, [3], [-0.5], "abort")])], [EOS])


class CharPolicy:
    """A stand-in policy: one id per character (offset 2), act() replays fixed samples."""

    def __init__(self, samples):
        self.samples = samples

    def encode(self, prompt):
        return [2 + CHARS.index(ch) for ch in prompt]

    def decode(self, ids):
        return "".join(CHARS[i - 2] for i in ids if i >= 2)

    def act(self, prompt_ids, group_size, greedy=False):
        assert len(self.samples) == len(prompt_ids) * group_size
        return self.samples


def test_rollout_batch_equals_the_hf_path():
    """Same completions, once as vLLM outputs through vllm_samples, once as HFPolicy-style tuples: the
    real MaxDigit rollout must build the identical Batch."""
    task = MaxDigit(eval_episodes=2)
    prompts = task.sample(2, np.random.default_rng(0))
    pol = CharPolicy([])
    ids = [pol.encode(p["prompt"]) for p in prompts]
    answer = [2 + CHARS.index(p["answer"]) for p in prompts]
    wrong = [2 + (a - 2 + 1) % 10 for a in answer]
    rows = [[([answer[0], EOS], [-0.5, -0.25], "stop"), ([wrong[0], 2, 3], [-1.0, -2.0, -3.0], "length")],
            [([wrong[1], EOS], [-0.75, -0.125], "stop"), ([answer[1], 4, 5], [-1.5, -2.5, -3.5], "length")]]
    hf = [(torch.tensor(c), torch.tensor(lp), fin == "length") for group in rows for c, lp, fin in group]
    fake = [FakeRequestOutput(p, [completion(j, c, lp, fin) for j, (c, lp, fin) in enumerate(group)])
            for p, group in zip(ids, rows)]
    a = task.rollout(CharPolicy(vllm_samples(fake, [EOS])), prompts, 2)
    b = task.rollout(CharPolicy(hf), prompts, 2)
    for name in ("states", "actions", "logp", "rewards", "mask", "truncated", "group_id"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    # rows: prompt 0 right, prompt 0 wrong, prompt 1 wrong, prompt 1 right -> reward on the last token
    assert a.rewards.sum(1).tolist() == [1.0, 0.0, 0.0, 1.0]
    assert a.mask.sum(1).tolist() == [2.0, 3.0, 2.0, 3.0]              # the EOS is a trained token
    assert a.truncated.tolist() == [False, True, False, True]


def test_lora_rank_is_checked_before_vllm_is_imported():
    with pytest.raises(ValueError, match="--lora-r 12 is not a rank vLLM serves: use one of 1, 8, 16"):
        VLLMGenerator("any-model", lora_r=12, max_staleness=1)


def test_missing_vllm_says_how_to_get_it():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the missing-vLLM message cannot be triggered")
    with pytest.raises(ValueError, match="--vllm needs vLLM on a CUDA machine: pip install vllm"):
        VLLMGenerator("any-model", lora_r=8, max_staleness=1)
