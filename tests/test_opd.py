"""On-policy distillation (--algo opd, --distill-coef, --teacher) and --export, on the tiny LM: the advantage
by hand, exact zeros (an identical teacher, mask-0 positions), GRPO + c x opd, 2 ranks = 1 process, the
vocabulary check, and an exported run read back as a model and as a teacher."""
import csv
import os

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("transformers", reason="the LLM path needs: pip install -r requirements-llm.txt")
import train  # noqa: E402
from algos import grpo, opd  # noqa: E402
from core import Batch  # noqa: E402
from model import HFPolicy, make_tiny_lm  # noqa: E402
from train import Config, export, make_teacher, policy_loss, set_weights, teacher_scores  # noqa: E402

from test_dist import free_port  # noqa: E402
from test_llm import as_batch  # noqa: E402
from test_train import grads_after  # noqa: E402


@pytest.fixture(scope="module")
def lms(tmp_path_factory):
    """Two tiny LMs with one vocabulary (other random weights: a teacher that disagrees), one with another."""
    d = tmp_path_factory.mktemp("lms")
    return (make_tiny_lm(str(d / "student")), make_tiny_lm(str(d / "teacher"), seed=1),
            make_tiny_lm(str(d / "letters"), chars="abc =,"))


def sampled(path, G=2, **kw):
    """An HFPolicy and a batch it sampled: 3 prompts x G rows, prompts masked, right padding."""
    torch.manual_seed(0)
    policy = HFPolicy(path, max_new_tokens=4, **kw)
    prompts = [policy.encode(p) for p in ("1 2 3=", "45=", "9 0 9 0=")]
    return policy, as_batch(prompts, policy.act(prompts, G), G)


def cfg_for(lms, **kw):
    return Config(**{"task": "maxdigit", "model": lms[0], "teacher": lms[1], "algo": "opd", **kw})


def test_advantage_and_loss_by_hand():
    """Row 0: prompt, 2 completion tokens, padding; row 1: prompt x 2, 2 completion tokens. Mask-0 entries hold
    junk, which must not leak. A = teacher - student where mask is 1:
        row 0: -1.0 - (-1.5) = 0.5,   -0.5 - (-0.5) = 0
        row 1: -2.0 - (-1.0) = -1.0,  -0.25 - (-1.0) = 0.75
    Loss at ratio 1 (token mean over 4 trained tokens): -(0.5 + 0 - 1.0 + 0.75) / 4 = -0.0625, and
    d loss / d logp_t = -A_t / 4: -0.125, 0, 0.25, -0.1875."""
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1.0]])
    batch = Batch(states=None, actions=None, logp=None, rewards=None, mask=mask, truncated=None,
                  final_states=None, group_size=1)
    teacher = torch.tensor([[-9.0, -1.0, -0.5, -9.0], [-9.0, -9.0, -2.0, -0.25]])
    student = torch.tensor([[-7.0, -1.5, -0.5, -3.0], [-1.0, -1.0, -1.0, -1.0]])
    adv, target = opd(batch, None, logp_teacher=teacher, logp_student=student)
    assert target is None
    assert adv.tolist() == [[0.0, 0.5, 0.0, 0.0], [0.0, 0.0, -1.0, 0.75]]
    logp = student.clone().requires_grad_()
    loss, ratio = policy_loss(logp, logp.detach(), adv, mask, 0.2, 0.2, "token", 4.0)
    loss.backward()
    assert loss.item() == -0.0625 and ratio.eq(1).all()
    assert logp.grad.tolist() == [[0.0, -0.125, 0.0, 0.0], [0.0, 0.0, 0.25, -0.1875]]


@pytest.mark.parametrize("lora", [0, 4])
def test_a_teacher_identical_to_the_student_gives_exactly_zero_advantage_and_gradient(lms, lora):
    """Teacher and student are one model (LoRA's B starts at 0): one scoring path, so 0 to the bit."""
    policy, batch = sampled(lms[0], lora_r=lora)
    cfg = Config(task="maxdigit", model=lms[0], teacher=lms[0], algo="opd", lora=lora > 0, micro_batch=4,
                 max_grad_norm=0.0)
    scores, stats = teacher_scores(make_teacher(cfg, policy), policy, batch, cfg)
    adv, _ = opd(batch, policy, **scores)
    assert batch.mask.sum() > 0 and adv.eq(0).all() and stats["teacher_kl"] == 0.0 and stats["teacher_s"] > 0
    grads, _ = grads_after(policy, cfg, batch, adv, None, 4)
    assert grads and all(g.eq(0).all() for g in grads)


def test_mask_zero_positions_prompt_padding_and_tool_replies_get_zero(lms):
    """A teacher that disagrees everywhere: nonzero advantage on every trained token, exactly 0 on the prompt,
    the padding, and a tool reply carved into completions (mask 1 0 0 1: context the model did not choose)."""
    policy, batch = sampled(lms[0], G=2)
    P = batch.mask.argmax(1)                                                   # [N] prompt lengths
    for i in range(len(batch)):                                                # a 2-token reply where it fits
        if batch.mask[i].sum() >= 4:
            batch.mask[i, P[i] + 1:P[i] + 3] = 0
    assert (batch.insertions() > 0).any()
    cfg = cfg_for(lms)
    teacher = make_teacher(cfg, policy)
    scores, stats = teacher_scores(teacher, policy, batch, cfg)
    adv, _ = opd(batch, policy, **scores)
    trained = batch.mask > 0
    assert adv[~trained].eq(0).all() and adv[trained].ne(0).all()
    assert scores["logp_teacher"][~trained].eq(0).all()                       # not even scored
    assert stats["teacher_kl"] == pytest.approx((-adv[trained]).mean().item(), rel=1e-5)


def test_distill_coef_adds_exactly_c_times_opd_to_grpos_advantage(lms, tmp_path, monkeypatch, capsys):
    """One step of the loop, GRPO + --distill-coef 0.5: the advantage update() gets is GRPO's plus 0.5 x opd's
    of that step's scores, to the bit; teacher_kl and teacher_s reach the CSV and the step line."""
    seen = {}

    def scores_seen(*args):
        seen["scores"], seen["stats"] = teacher_scores(*args)
        return seen["scores"], seen["stats"]

    def update_seen(policy, opt, batch, adv, *args):
        seen["batch"], seen["adv"] = batch, adv
        return update(policy, opt, batch, adv, *args)

    update = train.update
    monkeypatch.setattr(train, "teacher_scores", scores_seen)
    monkeypatch.setattr(train, "update", update_seen)
    out = str(tmp_path / "grpo_teacher")
    train.train(cfg_for(lms, algo="grpo", distill_coef=0.5, group_size=4, n_prompts=2, max_new_tokens=3, steps=1,
                        eval_every=0, solve_at=0.0, out=out))
    batch = seen["batch"]
    expected = grpo(batch, None, std_norm=True)[0] + 0.5 * opd(batch, None, **seen["scores"])[0]
    assert torch.equal(seen["adv"], expected) and not torch.equal(seen["adv"], grpo(batch, None, True)[0])
    row = list(csv.DictReader(open(out + ".csv")))[-1]
    assert float(row["teacher_kl"]) == seen["stats"]["teacher_kl"] and float(row["teacher_s"]) > 0
    assert "teacher_kl " in capsys.readouterr().out


def test_a_teacher_with_another_vocabulary_is_refused_before_any_work(lms, tmp_path):
    out = tmp_path / "refused"
    with pytest.raises(ValueError, match=f"--teacher {lms[2]} has another vocabulary .* than --model {lms[0]}"):
        train.train(Config(task="maxdigit", model=lms[0], teacher=lms[2], algo="opd", out=str(out)))
    assert not os.path.exists(str(out) + ".csv")                               # no step, no file


@pytest.mark.parametrize("kw,fix", [
    (dict(algo="opd"), "--teacher goes with"), (dict(algo="grpo", group_size=2, distill_coef=0.1), "--teacher goes"),
    (dict(algo="opd", teacher="t", distill_coef=0.1), "one of --algo opd"),
    (dict(algo="grpo", group_size=2, teacher="t"), "one of --algo opd"),
    (dict(task="cartpole", model="", algo="opd", teacher="t"), "--teacher, --max-tool-calls, --max-turns are for LLMs; cartpole trains an MLP"),
    (dict(algo="grpo", group_size=2, teacher="t", distill_coef=-1.0), "--distill-coef must be >= 0")])
def test_bad_teacher_settings_name_the_fix(kw, fix):
    with pytest.raises(ValueError, match=fix):
        train.validate(Config(**{"task": "maxdigit", "model": "m", **kw}))
    train.validate(Config(task="maxdigit", model="m", algo="opd", teacher="t", max_tool_calls=1))   # per token


@pytest.mark.parametrize("lora", [False, True])
def test_export_round_trip_and_the_folder_loads_as_a_teacher(lms, tmp_path, lora):
    """Two opd steps (a disagreeing teacher: the weights surely move), exported: the folder's log-probs are the
    checkpoint's (LoRA: merged into the base, to rounding), and as --teacher of that checkpoint, it agrees."""
    out, folder = str(tmp_path / "run"), str(tmp_path / "hf")
    cfg = cfg_for(lms, lora=lora, lora_r=4, lr=0.05, n_prompts=2, group_size=2, max_new_tokens=3, steps=2,
                  eval_every=0, solve_at=0.0, out=out)
    train.train(cfg)
    export([out + ".pt", folder])
    trained = train.make_policy(cfg, None)
    set_weights(trained, torch.load(out + ".pt")["policy"])
    policy, batch = sampled(lms[0])
    exported = HFPolicy(folder)
    ours, theirs = (p.logprobs(batch)[0].detach() for p in (trained, exported))
    assert not torch.allclose(ours, policy.logprobs(batch)[0].detach(), atol=1e-3)   # trained: not the base
    assert torch.allclose(ours, theirs, atol=1e-5) and (lora or torch.equal(ours, theirs))
    as_teacher = make_teacher(Config(task="maxdigit", model=lms[0], teacher=folder, algo="opd"), trained)
    scores, _ = teacher_scores(as_teacher, trained, batch, cfg)
    assert opd(batch, trained, **scores)[0].abs().max() < 1e-5


def test_export_refuses_a_control_run_and_an_unreadable_file(tmp_path):
    train.train(Config(steps=1, n_prompts=2, eval_every=0, solve_at=0.0, out=str(tmp_path / "cp")))
    with pytest.raises(ValueError, match="--export .*cp.pt: a --task cartpole run trained an MLP"):
        export([str(tmp_path / "cp.pt"), str(tmp_path / "hf")])
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="--export .*notes.pt is not a readable NanoRL checkpoint"):
        export([str(tmp_path / "notes.pt"), str(tmp_path / "hf")])
    with pytest.raises(ValueError, match="--export needs a checkpoint and a folder"):
        export([str(tmp_path / "cp.pt")])


def rank_main(rank, port, lms, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    from utils import init_distributed
    init_distributed()
    torch.save(distilled_grads(lms, rank), out + f".{rank}")
    torch.distributed.barrier()                         # nobody tears gloo down under a peer (SIGABRT)
    torch.distributed.destroy_process_group()


def distilled_grads(lms, rank=None):
    """This rank's half of the rows (None: all of them), scored and distilled -> (grads, teacher_kl)."""
    policy, batch = sampled(lms[0], G=2, lora_r=4)
    batch = batch[:6] if rank is None else batch[rank * 3:(rank + 1) * 3]
    cfg = cfg_for(lms, lora=True, loss_agg="seq", max_grad_norm=0.0, micro_batch=2)
    scores, stats = teacher_scores(make_teacher(cfg, policy), policy, batch, cfg)
    grads, _ = grads_after(policy, cfg, batch, opd(batch, policy, **scores)[0], None, 4)
    return grads, stats["teacher_kl"]


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process_with_a_teacher(lms, tmp_path):
    one, kl = distilled_grads(lms)
    out = str(tmp_path / "g")
    mp.start_processes(rank_main, args=(free_port(), lms, out), nprocs=2, start_method="spawn")
    for rank in range(2):
        two, kl2 = torch.load(out + f".{rank}")
        assert kl2 == pytest.approx(kl, rel=1e-6)                              # over both ranks' tokens
        for a, b in zip(one, two, strict=True):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-4), (a - b).abs().max()


def sharp(path, out):
    """A teacher that knows what it wants: a tiny LM whose final norm is scaled x8 (logits x8, peaked)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.model.norm.weight.mul_(8)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return out


@pytest.mark.slow
def test_async_trainer_scores_worker_batches_with_its_teacher_and_teacher_kl_falls(lms, tmp_path):
    """The trainer loads the teacher and scores the workers' batches; the worker is told of a teacher folder
    that does not exist, and runs: it never loads one."""
    from test_async import rows, start, wait, wait_for_port, workers
    port, teacher = free_port(), sharp(lms[1], str(tmp_path / "sharp"))
    common = ["--task", "maxdigit", "--model", lms[0], "--algo", "opd", "--group-size", 4, "--n-prompts", 4,
              "--max-new-tokens", 4, "--max-staleness", 1]
    trainer = start("--role", "trainer", "--serve-port", port, "--out", tmp_path / "opd", "--steps", 20,
                    "--eval-every", 0, "--solve-at", 0, "--lr", 5e-3, "--teacher", teacher, *common,
                    log=tmp_path / "trainer.log")
    ws = workers(port, 1, "--teacher", tmp_path / "no-such-teacher", *common, tmp=tmp_path)
    try:
        wait_for_port(port)
        assert wait(trainer, 300) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        assert wait(ws[0], 60) == 0, (tmp_path / "worker0.log").read_text()[-3000:]
    finally:
        for p in [trainer, *ws]:
            p.kill()
    kl = [float(r["teacher_kl"]) for r in rows(tmp_path / "opd.csv") if r["step"] != "0"]
    assert len(kl) == 20 and all(float(r["teacher_s"]) > 0 for r in rows(tmp_path / "opd.csv"))
    assert sum(kl[-5:]) / 5 < 0.5 * sum(kl[:3]) / 3, kl
