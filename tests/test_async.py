"""Disaggregated training with real processes on loopback: a trainer and rollout workers, faults,
hostile traffic, and the exact-old-log-probs machinery."""
import csv
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from core import Batch
from serve import Snapshots, TrainerClient
from test_dist import free_port
from test_serve import bad_batches, status_of
from test_train import ROOT
from train import Config, old_logprobs, train, trainable, validate

TOKEN = "async-test-token"
ENV = {**os.environ, "NANORL_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def start(*args, log=None):
    return subprocess.Popen([sys.executable, "train.py", *map(str, args)], cwd=ROOT, env=ENV, text=True,
                            stdout=open(log, "w") if log else subprocess.DEVNULL, stderr=subprocess.STDOUT)


def workers(port, n, *args, tmp=None, patience=10):
    return [start("--role", "rollout", "--trainer-url", f"http://127.0.0.1:{port}", "--trainer-patience", patience, *args,
                  log=tmp / f"worker{i}.log" if tmp else None) for i in range(n)]


def wait(p, timeout):
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise


def rows(path):
    return list(csv.DictReader(open(path)))


def wait_for_port(port, deadline=60):
    client = TrainerClient(f"http://127.0.0.1:{port}", TOKEN, patience=0)
    for _ in range(deadline * 10):
        try:
            return client.version()
        except Exception:
            time.sleep(0.1)
    raise TimeoutError("trainer never came up")


def test_trainer_and_two_workers_solve_cartpole(tmp_path):
    port = free_port()
    grpo = ["--config", "configs/cartpole_grpo.yaml"]            # REINFORCE without a baseline is slow at k=2
    trainer = start("--role", "trainer", "--serve-port", port, "--out", tmp_path / "cp", "--steps", 200, *grpo,
                    log=tmp_path / "trainer.log")
    ws = workers(port, 2, *grpo, tmp=tmp_path)
    try:
        assert wait(trainer, 240) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        for w in ws:
            w.kill() if wait_or_none(w, 60) is None else None
    log = (tmp_path / "trainer.log").read_text()
    assert "solved: eval_return 500" in log
    last = rows(tmp_path / "cp.csv")[-1]
    assert float(last["eval_return"]) == 500.0
    assert int(last["dropped_stale"]) == 0 and int(last["dropped_no_snapshot"]) == 0
    assert all("exiting after" in (tmp_path / f"worker{i}.log").read_text() for i in range(2))  # clean exits


def wait_or_none(p, timeout):
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    pytest.importorskip("transformers", reason="the LLM path needs: pip install -r requirements-llm.txt")
    from model import make_tiny_lm
    return make_tiny_lm(str(tmp_path_factory.mktemp("tiny")))


def test_tiny_llm_20_steps_two_workers_no_drops_and_zero_logp_gap(tmp_path, tiny_lm):
    port = free_port()
    common = ["--task", "maxdigit", "--model", tiny_lm, "--algo", "grpo", "--group-size", 4, "--n-prompts", 4,
              "--max-new-tokens", 2, "--max-staleness", 2]
    trainer = start("--role", "trainer", "--serve-port", port, "--out", tmp_path / "llm", "--steps", 20,
                    "--eval-every", 10, "--eval-episodes", 8, "--solve-at", 0, "--lr", 3e-3, *common,
                    log=tmp_path / "trainer.log")
    ws = workers(port, 2, *common)
    try:
        assert wait(trainer, 300) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        for w in ws:
            w.kill()
    r = rows(tmp_path / "llm.csv")
    steps = [x for x in r if x["step"] != "0"]
    assert len(steps) == 20 and int(steps[-1]["used"]) == 20
    assert all(int(steps[-1][k]) == 0 for k in ("dropped_stale", "dropped_no_snapshot", "evicted"))
    assert all(float(x["logp_gap"]) == 0.0 for x in steps)          # trainer recomputed exactly the worker's numbers
    assert max(float(x["staleness"]) for x in steps) <= 2 and any(float(x["staleness"]) > 0 for x in steps)


def test_a_killed_worker_costs_only_its_batch_and_a_late_one_catches_up(tmp_path):
    port = free_port()
    trainer = start("--role", "trainer", "--serve-port", port, "--out", tmp_path / "k", "--steps", 150, "--lease-timeout", 5,
                    "--solve-at", 0, "--eval-every", 0, log=tmp_path / "trainer.log")
    ws = workers(port, 2)
    wait_for_port(port)
    time.sleep(3)
    ws[0].send_signal(signal.SIGKILL)                                 # mid-run, possibly mid-generation
    late = workers(port, 1, tmp=tmp_path)[0]                          # joins at the current version
    try:
        assert wait(trainer, 240) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        assert wait(late, 60) == 0                                      # exits by itself once the trainer is gone
    finally:
        for w in ws[1:] + [late]:
            w.kill()
    assert rows(tmp_path / "k.csv")[-1]["step"] == "150"
    done = (tmp_path / "worker0.log").read_text().split("exiting after ")[1]
    assert int(done.split()[0]) >= 1                                  # the late worker's batches were used


def test_trainer_restart_with_resume_keeps_workers_and_versions(tmp_path):
    port = free_port()
    args = ["--role", "trainer", "--serve-port", port, "--out", tmp_path / "r", "--solve-at", 0, "--eval-every", 0]
    ws = workers(port, 2, patience=120)                                 # long enough for the restart below
    try:
        assert wait(start(*args, "--steps", 8, log=tmp_path / "t1.log"), 180) == 0
        client = TrainerClient(f"http://127.0.0.1:{port}", TOKEN, patience=0)
        second = start(*args, "--steps", 16, "--resume", tmp_path / "r.pt", log=tmp_path / "t2.log")
        assert wait_for_port(port) >= 9                               # version continues: step 8 -> version 9
        assert wait(second, 180) == 0, (tmp_path / "t2.log").read_text()[-3000:]
        assert all(w.poll() is None or w.returncode == 0 for w in ws)
    finally:
        for w in ws:
            w.kill()
    r = rows(tmp_path / "r.csv")
    assert [int(x["step"]) for x in r] == list(range(1, 17))          # one CSV, continued
    assert client is not None


def test_hostile_traffic_at_a_live_trainer_does_not_stop_training(tmp_path):
    port = free_port()
    trainer = start("--role", "trainer", "--serve-port", port, "--out", tmp_path / "h", "--steps", 30,
                    "--solve-at", 0, "--eval-every", 0, log=tmp_path / "trainer.log")
    ws = workers(port, 1)
    wait_for_port(port)
    marker = str(tmp_path / "unpickled")
    auth, statuses = {"Authorization": f"Bearer {TOKEN}"}, []
    for p in ("/version", "/info", "/weights?version=1", "/lease", "/batch", "/x", "/../etc/passwd"):
        for h in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
            statuses.append(status_of(port, "POST", p, h, b"{}"))
            statuses.append(status_of(port, "GET", p, h))
    for _ in range(3):
        statuses += [status_of(port, "POST", "/batch", auth, body) for body in bad_batches(marker)]
    try:
        assert wait(trainer, 240) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        for w in ws:
            w.kill()
    assert len(statuses) >= 200 and all(400 <= s < 500 for s in statuses), sorted(set(statuses))
    assert not os.path.exists(marker)
    assert rows(tmp_path / "h.csv")[-1]["step"] == "30"


def test_old_logprobs_swap_in_the_snapshot_and_restore_bit_for_bit():
    from model import MLPPolicy
    from tasks import CartPole
    torch.manual_seed(0)
    policy = MLPPolicy(4, 2, 16, critic=True)
    snaps = Snapshots(2)
    snaps.add(1, trainable(policy))
    batch = CartPole().rollout(policy, [1, 2, 3], 1)                  # sampled by version 1
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.1 * torch.randn_like(p))                         # the trainer moved on
    current = {n: p.clone() for n, p in policy.state_dict().items()}
    old = old_logprobs(policy, batch, snaps.get(1), micro_batch=2)
    assert all(torch.equal(current[n], p) for n, p in policy.state_dict().items())   # restored exactly
    assert torch.allclose(torch.cat(old) * batch.mask, batch.logp, atol=1e-6)  # version 1's numbers, not the current ones
    now = torch.cat([policy.logprobs(batch[s])[0] for s in batch.micro_batches(2)]).detach()
    assert not torch.allclose(now * batch.mask, batch.logp, atol=1e-3)


def test_async_roles_refuse_bad_settings(monkeypatch):
    monkeypatch.delenv("NANORL_TOKEN", raising=False)
    with pytest.raises(ValueError, match="--role trainer needs NANORL_TOKEN"):
        validate(Config(role="trainer"))
    monkeypatch.setenv("NANORL_TOKEN", TOKEN)
    with pytest.raises(ValueError, match="--role rollout needs --trainer-url"):
        validate(Config(role="rollout"))
    with pytest.raises(ValueError, match="--vllm is for --role rollout workers with --lora"):
        validate(Config(role="trainer", vllm=True))
    with pytest.raises(ValueError, match="--role leader is unknown"):
        validate(Config(role="leader"))


def test_worker_refuses_a_trainer_with_other_settings(tmp_path):
    port = free_port()
    trainer = start("--role", "trainer", "--serve-port", port, "--out", tmp_path / "m", "--steps", 2,
                    "--batch-timeout", 30, "--eval-every", 0)
    try:
        wait_for_port(port)
        w = start("--role", "rollout", "--trainer-url", f"http://127.0.0.1:{port}", "--hidden", 32,
                  log=tmp_path / "w.log")
        assert wait(w, 60) == 1
        assert "refusing to run: setting 'hidden': trainer 64, worker 32" in (tmp_path / "w.log").read_text()
    finally:
        trainer.kill()


def test_torchrun_trainer_ranks_each_take_a_batch_and_fail_together(tmp_path):
    port, master = free_port(), free_port()
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(master),
           "train.py", "--role", "trainer", "--serve-port", str(port), "--n-prompts", 8, "--solve-at", 0,
           "--eval-every", 0, "--batch-timeout", 5]
    trainer = subprocess.Popen([*map(str, run), "--steps", "6", "--out", str(tmp_path / "dp")], cwd=ROOT, env=ENV,
                               stdout=open(tmp_path / "t.log", "w"), stderr=subprocess.STDOUT)
    ws = workers(port, 2, tmp=tmp_path)
    try:
        assert wait(trainer, 180) == 0, (tmp_path / "t.log").read_text()[-3000:]
        assert wait(ws[0], 60) == 0, (tmp_path / "worker0.log").read_text()[-3000:]
    finally:
        for w in ws:
            w.kill()
    last = rows(tmp_path / "dp.csv")[-1]
    assert last["step"] == "6" and int(last["used"]) == 12             # one worker batch per rank per step
    # no workers at all: both ranks give up after --batch-timeout together, instead of hanging
    t0 = time.time()
    alone = subprocess.run([*map(str, run), "--steps", "2", "--out", str(tmp_path / "alone")], cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=120)
    assert alone.returncode != 0 and "TimeoutError" in alone.stdout + alone.stderr and time.time() - t0 < 60
