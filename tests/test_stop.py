"""A stop under torchrun never loses the run: torchrun forwards Ctrl-C / SIGTERM to every rank and SIGKILLs them
after its shutdown timeout (30 s by default), while a flagship step takes minutes. Here every step lasts longer
than the shutdown timeout, which is made short for the test (TORCH_ELASTIC_SHUTDOWN_TIMEOUT=2, a test setting):
a stop mid-generation and a stop mid-update each save the last finished step before the kill, and --resume
reaches the uninterrupted run's weights bit for bit. (Before the stop points, each rank finished its step first,
was SIGKILLed 3 s after the signal, and no checkpoint was written: measured with a 3 s timeout.)"""
import csv
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from test_cli import ENV, TRAIN, free_port

pytestmark = pytest.mark.slow
SHUTDOWN_S = 2            # the test setting: torchrun SIGKILLs a rank 2 s after forwarding the signal
# maxdigit on the tiny LM, made slow: 768 prompts x 8 samples x up to 48 tokens per step, over 2 ranks; on the
# 2-core EPYC ~2.7 s of generation, then ~5 s of update (quiet; 3x that beside other work)
ARGS = ["--config", "configs/tiny_maxdigit.yaml", "--n-prompts", 768, "--max-new-tokens", 48, "--micro-batch", 32,
        "--gen-batch", 1024, "--eval-every", 0, "--steps", 3]


def torchrun(*args, **kw):
    env = {**ENV, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(SHUTDOWN_S)}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                             str(free_port()), TRAIN, *map(str, args)], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, **kw)


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


def stop_in(p, csv_path, step, phase, how):
    """Signal torchrun while step + 1 is in `phase`, timed by step's own phases (the same machine, the same load):
    0.5 s into its rollout, or halfway through its update (epoch 0 is all of it here)."""
    row = row_of(csv_path, step, p)
    gen, upd = float(row["gen_s"]), float(row["train_s"])
    assert gen > 0.5 and upd > SHUTDOWN_S, f"steps too short to test this: {gen:.1f} + {upd:.1f} s"
    time.sleep(0.5 if phase == "generation" else gen + upd / 2)
    if how == "terminal Ctrl-C":
        os.killpg(p.pid, signal.SIGINT)                 # torchrun and both ranks, as a terminal does
    else:
        p.send_signal(signal.SIGTERM)                   # sky cancel: torchrun alone, which forwards it
    return p.communicate(timeout=120)[0]


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    pytest.importorskip("transformers", reason="the LLM stack: pip install -r requirements-llm.txt")
    from model import make_tiny_lm
    return make_tiny_lm(str(tmp_path_factory.mktemp("tiny")))


def test_a_stop_mid_generation_and_mid_update_saves_before_the_kill_and_resumes_exactly(tmp_path, tiny_lm):
    model = ["--model", tiny_lm]
    full = torchrun(*ARGS, *model, "--out", tmp_path / "full")
    assert full.wait(600) == 0, full.stdout.read()
    # stopped in step 2's generation: step 1 saved
    out = stop_in(torchrun(*ARGS, *model, "--out", tmp_path / "part"), tmp_path / "part.csv", 1, "generation",
                  "terminal Ctrl-C")
    assert "interrupted in step 2's rollout" in out and "as of step 1 of 3" in out, out
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300 torchrun --nproc_per_node=2" in out, out   # the printed resume
    assert torch.load(tmp_path / "part.pt")["step"] == 1
    # resumed, then stopped in step 3's update: step 2 saved, never half-updated
    out = stop_in(torchrun("--resume", tmp_path / "part.pt"), tmp_path / "part.csv", 2, "update", "sky cancel")
    assert "interrupted in the update, at micro-batch" in out and "as of step 2 of 3" in out, out
    assert torch.load(tmp_path / "part.pt")["step"] == 2
    last = torchrun("--resume", tmp_path / "part.pt")
    assert last.wait(600) == 0, last.stdout.read()
    part, want = torch.load(tmp_path / "part.pt"), torch.load(tmp_path / "full.pt")
    assert part["step"] == want["step"] == 3
    assert all(torch.equal(part["policy"][k], want["policy"][k]) for k in want["policy"])
    with open(tmp_path / "part.csv", newline="") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["1", "2", "3"]       # no row of a dropped step
