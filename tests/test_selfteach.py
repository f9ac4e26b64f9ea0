"""--teacher self, on the tiny LM: the model's own initial weights, shown what the task says the student must
find alone (tasks.LLMTask.privileged), grade each token the student sampled without it. The teacher's ids (the
privileged prompt, then exactly the student's completion, tool replies included), its log-probs at the
student's positions, exact zeros when it is shown nothing more, no second model with LoRA and one frozen copy
without, an evaluation that never sees the privileged text, 2 ranks = 1 process, and an async trainer."""
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("transformers", reason="the LLM path needs: pip install -r requirements-llm.txt")
import transformers  # noqa: E402

import train  # noqa: E402
from model import HFPolicy, make_tiny_lm  # noqa: E402
from tasks import TASKS, Addition, AdditionControl, MaxDigit, MaxMin  # noqa: E402
from train import Config, self_taught, update  # noqa: E402
from utils import Adam  # noqa: E402

from test_dist import free_port  # noqa: E402
from test_llm import as_batch, plain_logprobs  # noqa: E402
from test_tools import Scripted, lively  # noqa: E402


class Hinted(MaxDigit):
    """MaxDigit whose teacher is shown the answer after the prompt ('381=' -> '381=,8'): the tiny LM's characters."""
    hint = ",{answer}"


class Unhinted(MaxDigit):
    """A privileged prompt that is the student's own: the teacher sees exactly what the student saw."""
    hint = ""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_lm(str(tmp_path_factory.mktemp("lm") / "tiny"))


PROBLEMS = [{"prompt": "1=", "answer": "1"}, {"prompt": "77 0 5 4=", "answer": "7"}]


def sampled(policy, task, G=2, env=None):
    """A batch the policy sampled for PROBLEMS, G rows each, as task.rollout stacks it."""
    prompts = task.prompt_ids(policy.encode, PROBLEMS)
    torch.manual_seed(0)
    return as_batch(prompts, policy.act(prompts, G, env=env), G)


def test_the_teacher_scores_the_students_completion_after_the_privileged_prompt(tiny, monkeypatch):
    """Rows with real tool replies. The teacher's ids are the privileged prompt, then exactly the student's
    completion ids (the reply's too) and mask; its log-probs are a plain forward of those ids under the initial
    weights (the LoRA adapter off, though the student's has moved), moved back to the student's positions."""
    policy = lively(HFPolicy(tiny, lora_r=4, max_new_tokens=10))
    stop = policy.decode(policy.act([policy.encode("1=")], 1, greedy=True)[0][0][:2].tolist())
    task = Hinted()
    batch = sampled(policy, task, env=Scripted(stop, "42"))
    assert (batch.insertions() > 0).any(), "no row called the tool: pick other prompts"
    with torch.no_grad():                                      # the student moves away from its initial weights
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    seen = []
    score = policy.ref_logprobs
    monkeypatch.setattr(policy, "ref_logprobs", lambda b: seen.append(b) or score(b))
    out = self_taught(policy, task, batch, PROBLEMS, micro_batch=3)
    assert len(seen) == 2                                      # --micro-batch 3 of 4 rows
    teacher = replace(batch, states=torch.cat([b.states for b in seen]), mask=torch.cat([b.mask for b in seen]))
    P = batch.mask.argmax(1)
    trained = batch.mask > 0
    with policy.model.disable_adapter(), torch.no_grad():
        plain = plain_logprobs(policy.model, teacher)          # each teacher row alone, whole, the adapter off
        student = plain_logprobs(policy.model, batch)
    for i in range(len(batch)):
        shown = policy.encode(PROBLEMS[i // 2]["prompt"] + f",{PROBLEMS[i // 2]['answer']}")
        n, C = len(shown), batch.states.shape[1] - int(P[i])
        assert teacher.states[i, :n].tolist() == shown and teacher.mask[i, :n].eq(0).all()
        assert teacher.states[i, n:n + C].tolist() == batch.states[i, int(P[i]):].tolist()
        assert teacher.mask[i, n:n + C].tolist() == batch.mask[i, int(P[i]):].tolist()
        assert (out[i, int(P[i]):] - plain[i, n:n + C]).abs().max() < 1e-5        # fp32 rounding: forwards differ
    assert out[~trained].eq(0).all() and (out - student)[trained].abs().max() > 0.01   # shown more: it differs


@pytest.mark.parametrize("lora", [0, 4])
def test_an_empty_privileged_context_reproduces_the_students_logprobs_so_advantage_and_gradient_are_0(tiny, lora):
    """Shown nothing beyond the student's prompt, the initial weights (LoRA: the adapter off, at its zero init;
    full fine-tuning: the frozen copy) give the student's log-probs bit for bit: opd's advantage and gradient
    are exactly 0."""
    policy = HFPolicy(tiny, lora_r=lora, max_new_tokens=6, ref_copy=not lora)
    batch = sampled(policy, Unhinted(), G=3)
    teacher_logp = self_taught(policy, Unhinted(), batch, PROBLEMS, micro_batch=0)
    cfg = Config(task="maxdigit", model=tiny, teacher="self", algo="opd", lora=lora > 0, ref_copy=not lora)
    opt = Adam(list(policy.param_groups().values()), lr=0.0)
    stats, adv = update(policy, opt, batch, torch.zeros_like(batch.mask), None, cfg, 6, None, teacher_logp)
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    assert batch.mask.sum() > 0 and adv.eq(0).all() and stats["teacher_kl"] == 0.0
    assert grads and all(g.eq(0).all() for g in grads)


def test_self_is_refused_where_there_is_nothing_to_show_or_no_initial_weights(tiny, monkeypatch):
    """A task whose privileged() is None (MaxMin) is refused before any weights load, naming the method; full
    fine-tuning needs --ref-copy (the frozen copy), which it shares with --kl-coef; LoRA needs nothing."""
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", None)   # any load: a TypeError
    with pytest.raises(ValueError, match=r"--teacher self: MaxMin.privileged\(problem\) returns None.*"
                                         r"define it \(tasks.LLMTask.hint\), or pass --teacher MODEL"):
        train.make_teacher(Config(task="maxmin", model=tiny, teacher="self"), MaxMin())
    assert MaxMin().privileged(PROBLEMS[0]) is None and MaxDigit().privileged(PROBLEMS[0]) is None
    ok = dict(task="addition", model=tiny, teacher="self", algo="opd")
    with pytest.raises(ValueError, match="--teacher self with full fine-tuning need the initial weights: add "
                                         "--lora .* or --ref-copy"):
        train.validate(Config(**ok))
    for fine in (dict(lora=True), dict(ref_copy=True), dict(ref_copy=True, kl_coef=0.1)):
        train.validate(Config(**ok, **fine))


def test_the_built_in_tasks_privileged_prompts_and_the_controls():
    """Addition and Multiply show the answer, Countdown a solution, GSM8K the worked solution and its number;
    the control shows another problem's answer in the same words; tasks without a reference show nothing."""
    rng = np.random.default_rng(0)
    p = Addition().sample(1, rng)[0]
    assert Addition().privileged(p) == p["prompt"] + f" (The answer is {p['answer']}.)"
    wrong = AdditionControl().privileged(p)
    assert wrong.startswith(p["prompt"] + " (The answer is ") and wrong != Addition().privileged(p)
    assert wrong == AdditionControl().privileged(p)                      # a fixed other problem, not a new draw
    q = TASKS["multiply"]().sample(1, rng)[0]
    assert TASKS["multiply"]().privileged(q).endswith(f" (The answer is {q['answer']}.)")
    c = TASKS["countdown"]().sample(1, rng)[0]
    assert TASKS["countdown"]().privileged(c) == c["prompt"] + f" (One solution: <answer>{c['solution']}</answer>)"
    gsm = {"prompt": "Q", "answer": "72", "solution": "48/2 = 24\n48+24 = 72"}
    assert object.__new__(TASKS["gsm8k"]).privileged(gsm) == "Q\n(A worked solution: 48/2 = 24\n48+24 = 72 The answer: 72.)"
    for name in ("maxdigit", "maxmin", "guess", "guess_blind"):
        assert TASKS[name].hint is None


def test_a_lora_run_loads_no_second_model_and_evaluation_never_sees_the_privileged_text(tiny, tmp_path, monkeypatch,
                                                                                         capsys):
    """A LoRA run of --teacher self loads one model (from_pretrained once, one load line, its parameters the
    model's and the adapters'); every prompt the held-out evaluation renders is the problem's own, while the
    teacher's (rendered too) hold the answer; samples.jsonl's records show no privileged text."""
    monkeypatch.setitem(TASKS, "hinted", Hinted)
    loads, rendered, evaluating = [], [], []
    load = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: loads.append(a[0]) or load(*a, **k))
    encode = HFPolicy.encode
    monkeypatch.setattr(HFPolicy, "encode", lambda self, text, system=None: rendered.append(
        (bool(evaluating), text)) or encode(self, text, system))
    evaluate = Hinted.evaluate

    def evaluating_now(self, *args, **kwargs):
        evaluating.append(1)
        try:
            return evaluate(self, *args, **kwargs)
        finally:
            evaluating.clear()
    monkeypatch.setattr(Hinted, "evaluate", evaluating_now)
    out = str(tmp_path / "self")
    train.train(Config(task="hinted", model=tiny, teacher="self", algo="grpo", distill_coef=1.0, lora=True,
                       lora_r=4, n_prompts=4, group_size=2, max_new_tokens=2, steps=2, eval_every=1,
                       eval_episodes=20, solve_at=0.0, out=out))
    assert loads == [tiny]                                          # the student alone; its base is the teacher
    log = capsys.readouterr().out
    assert log.count("loaded ") == 1
    eval_set = {p["prompt"] for p in Hinted(eval_episodes=20).eval_set}
    shown = [text for during, text in rendered if during]
    assert shown and set(shown) <= eval_set                        # evaluation: the problems' own prompts
    taught = [text for during, text in rendered if not during and "," in text]
    assert taught and all(t.partition(",")[0] not in eval_set for t in taught)   # training draws, hinted
    records = [json.loads(line) for line in open(out + ".samples.jsonl")]
    assert records and not any("," in r["prompt"] for r in records)


def test_full_fine_tuning_loads_one_frozen_copy_shared_with_the_kl_reference(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(TASKS, "hinted", Hinted)
    loads = []
    load = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: loads.append(a[0]) or load(*a, **k))
    row = train.train(Config(task="hinted", model=tiny, teacher="self", algo="grpo", distill_coef=1.0,
                             ref_copy=True, kl_coef=0.1, n_prompts=2, group_size=2, max_new_tokens=2, steps=1,
                             eval_every=0, solve_at=0.0, out=str(tmp_path / "full")))
    assert loads == [tiny, tiny] and row["kl"] == 0.0 and "teacher_kl" in row    # the student, one copy


def rank_main(rank, port, tiny, out):
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    torch.save(self_taught_grads(tiny, rank), out + f".{rank}")
    torch.distributed.destroy_process_group()


def self_taught_grads(tiny, rank=None):
    """This rank's half of the rows (None: all), graded by the hinted initial weights -> (grads, teacher_kl)."""
    policy = lively(HFPolicy(tiny, lora_r=4, max_new_tokens=4))
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:                               # a student already away from its teacher
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    batch = sampled(policy, Hinted(), G=2)
    problems = PROBLEMS if rank is None else PROBLEMS[rank:rank + 1]
    batch = batch if rank is None else batch[rank * 2:(rank + 1) * 2]
    cfg = Config(task="maxdigit", model=tiny, teacher="self", algo="opd", lora=True, loss_agg="seq",
                 max_grad_norm=0.0, micro_batch=1)
    opt = Adam(list(policy.param_groups().values()), lr=0.0)
    teacher_logp = self_taught(policy, Hinted(), batch, problems, cfg.micro_batch)
    stats, _ = update(policy, opt, batch, torch.zeros_like(batch.mask), None, cfg, 4, None, teacher_logp)
    return [p.grad.clone() for p in policy.parameters() if p.grad is not None], stats["teacher_kl"]


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process_with_the_self_teacher(tiny, tmp_path):
    one, kl = self_taught_grads(tiny)
    out = str(tmp_path / "g")
    mp.start_processes(rank_main, args=(free_port(), tiny, out), nprocs=2, start_method="spawn")
    for rank in range(2):
        two, kl2 = torch.load(out + f".{rank}")
        assert kl2 == pytest.approx(kl, rel=1e-6)
        for a, b in zip(one, two, strict=True):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-4), (a - b).abs().max()


@pytest.mark.slow
def test_an_async_trainer_draws_each_lease_again_and_its_self_teacher_grades_the_workers_batches(tiny, tmp_path):
    """A trainer with --teacher self and a worker, over loopback: the trainer draws each batch's problems again
    from its lease (a batch whose prompts differ would stop it) and grades every row; the worker loads no
    teacher. Addition on the tiny LM: its letters are unknown characters, the answer's digits are not."""
    from test_async import rows, trainer_and_worker
    common = ["--task", "addition", "--model", tiny, "--lora", "--algo", "grpo", "--group-size", 2,
              "--n-prompts", 4, "--max-new-tokens", 3, "--max-staleness", 1]
    trainer_and_worker(free_port(), tmp_path, ["--out", tmp_path / "self", "--steps", 6, "--eval-every", 0,
                                               "--solve-at", 0, "--teacher", "self", "--distill-coef", 1], common)
    got = [r for r in rows(tmp_path / "self.csv") if r["step"] != "0"]
    assert len(got) == 6 and all(float(r["teacher_s"]) > 0 and r["rows_trained"] == "8" for r in got)
    assert all(abs(float(r["teacher_kl"])) > 0 for r in got)      # the answer shown: it grades otherwise
    assert (tmp_path / "worker0.log").read_text().count("loaded ") == 1            # the student alone
