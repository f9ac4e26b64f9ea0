"""A stop never loses the run. Ctrl-C or SIGTERM wakes a thread that saves the last finished step at once, even
while the main thread is inside one long forward (train.StopRequests, train.LastStep), and the main thread stops
at its next check, every rank together. torchrun forwards the signal to every rank and SIGKILLs them after its
shutdown timeout (30 s by default, fixed on torch 2.11), while a flagship micro-batch can take minutes.

The fast tier drives the handler in this process: a main thread held where no Python signal handler runs (the
signal blocked on it, so that another thread's C handler takes it, as when the main thread is inside a long
C++ op) while the saver writes the step before; the update's check between micro-batches; a generation dropped
at once; a step of several optimizer steps, and an async trainer's scoring under an older snapshot, saved as
the step before. The slow tier runs torchrun for real."""
import csv
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from algos import reinforce
from model import MLPPolicy
from tasks import CartPole
from test_cli import ENV, TRAIN, free_port
from train import Config, LastStep, StopRequests, StopRun, behav_logprobs, trainable, update
from utils import Adam


def held(seconds, seen, stop, path):
    """The main thread busy `seconds` s where no Python handler can run, while another thread sends SIGINT
    0.2 s in; then what <path> holds, and whether it was written a second before the main thread was free."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})       # the kernel gives it to another thread
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        time.sleep(seconds)
        free = time.time()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    seen["saved"] = torch.load(path) if os.path.exists(path) else None
    seen["while_held"] = seen["saved"] is not None and os.path.getmtime(path) < free - 1


def cartpole_step(tmp_path, **kw):
    """A CartPole policy, its optimizer and batch, a LastStep at step 4 whose update would make step 5."""
    cfg = Config(out=str(tmp_path / "run"), max_grad_norm=0.0, **kw)
    torch.manual_seed(0)
    policy = MLPPolicy(4, 2, 16)
    opt = Adam(list(policy.param_groups().values()), lr=0.1)
    batch = CartPole().rollout(policy, [1, 2, 3, 4], 1)
    last = LastStep(cfg, policy, opt, {"step": 4, "env_steps": 100, "run_id": "r"}, saving=True)
    last.pending = last.state | {"step": 5, "env_steps": 150}
    before = {n: p.detach().clone() for n, p in trainable(policy).items()}
    return cfg, policy, opt, batch, reinforce(batch, policy, 0.99)[0], last, before


def hold_at_forward(policy, call, seen, stop, path):
    """policy.actor's forward number `call` (0: the first) is held (held())."""
    calls = []

    def hook(module, args):
        if len(calls) == call:
            held(2.5, seen, stop, path)
        calls.append(1)
    return policy.actor.register_forward_pre_hook(hook)


def test_a_stop_inside_a_long_micro_batch_is_saved_before_it_ends_and_the_update_stops_after_it(tmp_path):
    """4 micro-batches; the signal comes in the first, which lasts 2.5 s: the saver has written step 4 with the
    weights before the update while the main thread is still inside it, and the update raises StopRun at its next
    micro-batch without an optimizer step."""
    cfg, policy, opt, batch, adv, last, before = cartpole_step(tmp_path, micro_batch=1)
    seen = {}
    with StopRequests(last) as stop:
        hook = hold_at_forward(policy, 0, seen, stop, cfg.out + ".pt")
        with pytest.raises(StopRun, match="in the update, at micro-batch 2 of 4"):
            update(policy, opt, batch, adv, None, cfg, 500, stop=stop)
        hook.remove()
    assert seen["while_held"] and seen["saved"]["step"] == 4 and seen["saved"]["finished"] == ""
    assert all(torch.equal(seen["saved"]["policy"][n], w) for n, w in before.items())
    assert all(torch.equal(p, before[n]) for n, p in trainable(policy).items()) and last.state["step"] == 4


def test_a_step_of_several_optimizer_steps_is_saved_as_the_step_before_never_half_applied(tmp_path):
    """--inner-epochs 3, the signal in epoch 2 (after one optimizer step): the saver writes the copy of step 4
    taken before the first optimizer step; once the step is done, a save writes step 5 and its weights."""
    cfg, policy, opt, batch, adv, last, before = cartpole_step(tmp_path, inner_epochs=3)
    seen = {}
    with StopRequests(last) as stop:
        hook = hold_at_forward(policy, 1, seen, stop, cfg.out + ".pt")
        update(policy, opt, batch, adv, None, cfg, 500, stop=stop)
        hook.remove()
    assert seen["while_held"] and seen["saved"]["step"] == 4
    assert all(torch.equal(seen["saved"]["policy"][n], w) for n, w in before.items())   # not epoch 1's weights
    assert seen["saved"]["optimizer"]["t"] == 0                                         # nor its Adam state
    assert last.state["step"] == 5 and last.stand_in is None
    last.save()
    saved = torch.load(cfg.out + ".pt")
    assert saved["step"] == 5 and saved["optimizer"]["t"] == 3
    assert all(torch.equal(saved["policy"][n], p) for n, p in trainable(policy).items())


def test_a_stop_while_an_async_trainer_scores_under_an_older_snapshot_saves_the_current_weights(tmp_path):
    cfg, policy, opt, batch, adv, last, before = cartpole_step(tmp_path)
    snapshot = {n: w + 1.0 for n, w in before.items()}                  # another version's weights
    seen = {}
    with StopRequests(last) as stop:
        hook = hold_at_forward(policy, 0, seen, stop, cfg.out + ".pt")
        behav_logprobs(policy, batch, snapshot, batch.micro_batches(0), last)
        hook.remove()
    assert seen["while_held"] and all(torch.equal(seen["saved"]["policy"][n], w) for n, w in before.items())
    assert all(torch.equal(p, before[n]) for n, p in trainable(policy).items())          # restored


def test_a_stop_during_generation_raises_at_once_and_a_second_quits():
    with StopRequests() as stop:
        t0 = time.monotonic()
        with pytest.raises(StopRun), stop.at_once():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)                               # a generation: the handler raises inside it
        assert time.monotonic() - t0 < 2 and stop.asked
        stop.asked = time.monotonic() - 3               # the first signal, 3 s ago
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        with pytest.raises(StopRun, match="here"):
            stop.agree("here")                          # the loop's check: every rank raises
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler             # restored


# ---- torchrun, for real (slow) ----

SHUTDOWN_S = 2            # a test setting: torchrun SIGKILLs a rank 2 s after forwarding the signal
# maxdigit on the tiny LM, made slow: 768 prompts x 8 samples x up to 48 tokens per step, over 2 ranks; on the
# 2-core EPYC ~2.7 s of generation, then ~5 s of update (quiet; 3x that beside other work)
ARGS = ["--config", "configs/tiny_maxdigit.yaml", "--n-prompts", 768, "--max-new-tokens", 48, "--micro-batch", 32,
        "--gen-batch", 1024, "--eval-every", 0, "--steps", 3, "--every-row"]   # every row: updates long enough


def torchrun(*args, shutdown_s=SHUTDOWN_S, **kw):
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                             str(free_port()), "--shutdown-timeout", str(shutdown_s), TRAIN, *map(str, args)],
                            env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, **kw)


def row_of(path, step, p):
    """Wait until the CSV has step's row (written when the step ends, as the next one begins) -> the row."""
    while True:
        assert p.poll() is None, p.stdout.read()
        if os.path.exists(path):
            with open(path, newline="") as f:
                found = [r for r in csv.DictReader(f) if r["step"] == str(step)]
            if found:
                return found[0]
        time.sleep(0.02)


def stop_in(p, csv_path, step, phase, how, shutdown_s=SHUTDOWN_S):
    """Signal torchrun while step + 1 is in `phase`, timed by step's own phases (the same machine, the same load):
    0.5 s into its rollout, halfway through its update, or 2 s into it ("update start": its micro-batch must
    outlast the shutdown timeout from there) -> (its output, seconds from the signal to torchrun's exit)."""
    row = row_of(csv_path, step, p)
    gen, upd = float(row["gen_s"]), float(row["train_s"])
    long_enough = upd > (shutdown_s + 4 if phase == "update start" else shutdown_s)
    assert gen > 0.5 and long_enough, f"steps too short to test this: {gen:.1f} + {upd:.1f} s"
    time.sleep({"generation": 0.5, "update": gen + upd / 2, "update start": gen + 2}[phase])
    signalled = time.time()
    if how == "terminal Ctrl-C":
        os.killpg(p.pid, signal.SIGINT)                 # torchrun and both ranks, as a terminal does
    else:
        p.send_signal(signal.SIGTERM)                   # sky cancel: torchrun alone, which forwards it
    out = p.communicate(timeout=180)[0]
    return out, time.time() - signalled


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    pytest.importorskip("transformers", reason="the LLM stack: pip install -r requirements-llm.txt")
    from model import make_tiny_lm
    return make_tiny_lm(str(tmp_path_factory.mktemp("tiny")))


def same_weights(a, b):
    return torch.load(a)["step"] == torch.load(b)["step"] and all(
        torch.equal(torch.load(a)["policy"][k], w) for k, w in torch.load(b)["policy"].items())


def csv_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_a_stop_mid_generation_and_mid_update_saves_before_the_kill_and_resumes_exactly(tmp_path, tiny_lm):
    model = ["--model", tiny_lm]
    full = torchrun(*ARGS, *model, "--out", tmp_path / "full")
    assert full.wait(600) == 0, full.stdout.read()
    # stopped in step 2's generation: step 1 saved
    out, took = stop_in(torchrun(*ARGS, *model, "--out", tmp_path / "part"), tmp_path / "part.csv", 1,
                        "generation", "terminal Ctrl-C")
    assert "interrupted in step 2's rollout" in out and "as of step 1 of 3" in out and took < 15, (took, out)
    assert "continue with:\n    torchrun --nproc_per_node=2" in out, out          # the printed resume
    assert torch.load(tmp_path / "part.pt")["step"] == 1
    # resumed, then stopped in step 3's update: step 2 saved, never half-updated
    out, took = stop_in(torchrun("--resume", tmp_path / "part.pt"), tmp_path / "part.csv", 2, "update", "sky cancel")
    assert "interrupted in the update, at micro-batch" in out and "as of step 2 of 3" in out and took < 15, out
    assert torch.load(tmp_path / "part.pt")["step"] == 2
    last = torchrun("--resume", tmp_path / "part.pt")
    assert last.wait(600) == 0, last.stdout.read()
    assert same_weights(tmp_path / "part.pt", tmp_path / "full.pt") and torch.load(tmp_path / "full.pt")["step"] == 3
    assert [r["step"] for r in csv_rows(tmp_path / "part.csv")] == ["1", "2", "3"]   # no row of a dropped step


@pytest.mark.slow
def test_a_micro_batch_longer_than_the_shutdown_timeout_is_saved_within_seconds_and_resumes_exactly(tmp_path,
                                                                                                  tiny_lm):
    """--micro-batch 0: each step's update is one micro-batch (3072 prompts x 8 x up to 48 tokens over 2 ranks,
    every row computed: ~15-30 s on the 2-core EPYC), longer than torchrun's --shutdown-timeout 10. Ctrl-C 2 s
    into it: no rank reaches a stop check before torchrun SIGKILLs it, yet step 1 is on disk within seconds of the signal,
    torchrun exits by the timeout, and --resume trains steps 2 and 3 as the uninterrupted run did: the same
    rows (the same samples drawn: rewards, lengths) and the same weights, bit for bit."""
    args = [*ARGS, "--model", tiny_lm, "--n-prompts", 3072, "--micro-batch", 0, "--gen-batch", 4096]
    full = torchrun(*args, "--out", tmp_path / "full", shutdown_s=10)
    assert full.wait(900) == 0, full.stdout.read()
    part = torchrun(*args, "--out", tmp_path / "part", shutdown_s=10)
    out, took = stop_in(part, tmp_path / "part.csv", 1, "update start", "terminal Ctrl-C", shutdown_s=10)
    signalled = time.time() - took                      # torchrun has just exited
    assert "saved" in out and "as of step 1, the last finished one" in out, out
    assert os.path.getmtime(tmp_path / "part.pt") - signalled < 5, "not saved within seconds of the signal"
    assert "interrupted in" not in out and took < 10 + 15, (took, out)            # killed mid micro-batch
    assert torch.load(tmp_path / "part.pt")["step"] == 1
    resumed = torchrun("--resume", tmp_path / "part.pt", shutdown_s=10)
    assert resumed.wait(900) == 0, resumed.stdout.read()
    assert same_weights(tmp_path / "part.pt", tmp_path / "full.pt")
    columns = ("step", "reward", "completion_len", "truncated_frac", "zero_std_frac", "loss", "grad_norm")
    assert [[r[c] for c in columns] for r in csv_rows(tmp_path / "part.csv")] == \
        [[r[c] for c in columns] for r in csv_rows(tmp_path / "full.csv")]
