"""Disaggregated training with real processes on loopback: a trainer and rollout workers, faults,
hostile traffic, and the exact-old-log-probs machinery."""
import contextlib
import csv
import os
import re
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from core import Batch
from model import MLPPolicy
import train as train_module
from serve import Rejected, Snapshots, TrainerClient, TrainerGone, TrainerServer, batch_to_bytes, describe
from test_dist import free_port
from test_serve import bad_batches, bad_for_the_run, make_batch, status_of, status_raw
from test_train import ROOT
from train import (Config, batch_limits, fingerprint, make_task, behav_logprobs, rollout_worker, logprobs_no_grad, train,
                   trainable, validate)

TOKEN = "async-test-token"
ENV = {**os.environ, "NANORL_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def start(*args, log=None):
    return subprocess.Popen([sys.executable, "train.py", *map(str, args)], cwd=ROOT, env=ENV, text=True,
                            stdout=open(log, "w") if log else subprocess.DEVNULL, stderr=subprocess.STDOUT)


def workers(port, n, *args, tmp=None, patience=120):
    """Rollout workers, started beside their trainer: on a busy machine a trainer (torchrun's two ranks above all)
    can take well over 10 s to serve, so they wait up to 120 s for it; at the run's end they hear so and exit."""
    return [start("--role", "rollout", "--trainer-url", f"http://127.0.0.1:{port}", "--trainer-patience", patience, *args,
                  log=tmp / f"worker{i}.log" if tmp else None) for i in range(n)]


def trainer_and_worker(port, tmp, trainer_args, common):
    """A trainer and one worker on loopback, run to their ends: both exit 0 (else their logs' tails)."""
    trainer = start("--role", "trainer", "--serve-port", port, *trainer_args, *common, log=tmp / "trainer.log")
    ws = workers(port, 1, *common, tmp=tmp)
    try:
        wait_for_port(port)
        assert wait(trainer, 300) == 0, (tmp / "trainer.log").read_text()[-3000:]
        assert wait(ws[0], 60) == 0, (tmp / "worker0.log").read_text()[-3000:]
    finally:
        for p in [trainer, *ws]:
            p.kill()


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
            return client.info()["version"]
        except Exception:
            time.sleep(0.1)
    raise TimeoutError("trainer never came up")


@pytest.mark.slow
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


def refused_by_a_live_trainer(port):
    """Send every batch the live trainer's run cannot produce (its /info limits), with a valid token and run:
    -> the number sent. Each must get a 400 naming the defect."""
    client = TrainerClient(f"http://127.0.0.1:{port}", TOKEN, patience=0)
    info = client.info()
    cases = bad_for_the_run(info["limits"], version=info["version"])
    for why, bad in cases:       # lease "x" was never granted: a 400 (not a 409) shows the batch was checked first
        with pytest.raises(Rejected) as e:
            client._call("POST", "/batch", batch_to_bytes(bad, "x", info["run"]))
        assert e.value.status == 400 and why in str(e.value), (why, str(e.value))
    return len(cases)


@pytest.mark.slow
def test_tiny_llm_20_steps_two_workers_no_drops_and_the_real_logp_gap(tmp_path, tiny_lm):
    port = free_port()
    common = ["--task", "maxdigit", "--model", tiny_lm, "--algo", "grpo", "--group-size", 4, "--n-prompts", 4,
              "--max-new-tokens", 2, "--max-staleness", 2]
    trainer = start("--role", "trainer", "--serve-port", port, "--out", tmp_path / "llm", "--steps", 20,
                    "--eval-every", 10, "--eval-episodes", 8, "--solve-at", 0, "--lr", 3e-3, *common,
                    log=tmp_path / "trainer.log")
    ws = workers(port, 2, *common)
    try:
        wait_for_port(port)
        sent = refused_by_a_live_trainer(port)           # token ids past the vocabulary, a mask on position 0, ..
        assert wait(trainer, 300) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        for w in ws + [trainer]:
            w.kill()
    r = rows(tmp_path / "llm.csv")
    steps = [x for x in r if x["step"] != "0"]
    assert len(steps) == 20 and int(steps[-1]["used"]) == 20 and int(steps[-1]["refused"]) == sent >= 12
    assert all(int(steps[-1][k]) == 0 for k in ("dropped_stale", "dropped_no_snapshot", "evicted"))
    # the workers' decode-time log-probs against the trainer's full forward, in fp32: rounding only (~1e-7), on
    # the steps that computed rows (a step whose groups all have equal rewards computes none: blank, 7 of 20 here)
    computed = [x for x in steps if int(x["rows_trained"]) > 0]
    gaps = [float(x["logp_gap"]) for x in computed]
    assert all(x["logp_gap"] == "" for x in steps if x not in computed) and len(computed) >= 5
    assert max(gaps) < 1e-4 and sum(g > 0 for g in gaps) >= 3 and all(float(x["gap_out_frac"]) == 0 for x in computed)
    assert max(float(x["staleness"]) for x in steps) <= 2 and any(float(x["staleness"]) > 0 for x in steps)


def test_llm_behav_logprobs_equal_a_direct_scoring_and_the_sampler_gap_is_real(tiny_lm):
    """The trainer's recompute is exact: version 1's snapshot swapped in gives, bit for bit, what a model
    holding version 1's weights scores. The sampler's decode-time log-probs differ from it by rounding only."""
    from model import HFPolicy
    from tasks import MaxDigit
    policy, direct = HFPolicy(tiny_lm, max_new_tokens=8), HFPolicy(tiny_lm, max_new_tokens=8)   # both version 1
    task, snaps = MaxDigit(eval_episodes=2, max_new_tokens=8), Snapshots(2)
    snaps.add(1, trainable(policy))
    torch.manual_seed(0)
    batch = task.rollout(policy, task.sample(4, np.random.default_rng(0)), 4)      # sampled by version 1
    with torch.no_grad():
        for p in trainable(policy).values():
            p.add_(0.05 * torch.randn_like(p))                                    # the trainer moved on
    old = torch.cat(behav_logprobs(policy, batch, snaps.get(1), batch.micro_batches(4)))
    assert torch.equal(old, logprobs_no_grad(direct, batch, 4))
    gap = (batch.logp - old).abs()[batch.mask.bool()]                              # KV-cached decode vs full forward
    assert 0 < gap.max() < 1e-4 and batch.mask.sum() >= 16


def poll_rows(path, until, timeout=60):
    """Rows of the trainer's CSV once until(rows) holds."""
    for _ in range(timeout * 10):
        r = rows(path) if os.path.exists(path) else []
        if r and until(r):
            return r
        time.sleep(0.1)
    raise TimeoutError(f"{path}: condition not met in {timeout} s")


@pytest.mark.slow
def test_an_abandoned_lease_and_a_killed_worker_stall_training_for_seconds(tmp_path):
    """Default --lease-timeout (5 s). A lease taken and never renewed, then kill -9 of a worker that is
    (most likely) generating: each costs one wait of at most --lease-timeout, and the killed worker its batch."""
    port, csv_path = free_port(), tmp_path / "k.csv"
    trainer = start("--role", "trainer", "--serve-port", port, "--out", tmp_path / "k", "--steps", 60, "--solve-at", 0,
                    "--eval-every", 0, log=tmp_path / "trainer.log")
    ws = workers(port, 2)
    late = None
    try:
        wait_for_port(port)
        n0 = len(poll_rows(csv_path, lambda r: len(r) >= 3))
        assert TrainerClient(f"http://127.0.0.1:{port}", TOKEN).lease(wait=10)    # abandoned: never renewed
        n1 = len(poll_rows(csv_path, lambda r: int(r[-1]["leases_expired"]) >= 1 and len(r) >= n0 + 8))
        ws[0].send_signal(signal.SIGKILL)                                           # mid-batch
        late = workers(port, 1, tmp=tmp_path, patience=3)[0]                        # joins at the current version
        assert wait(trainer, 120) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        assert wait(late, 60) == 0                                                  # exits once the trainer is gone
    finally:
        for w in ws[1:] + [late, trainer]:
            w and w.kill()
    r = rows(csv_path)
    step_s = [float(x["step_s"]) for x in r]
    typical = float(np.median(step_s))
    stalls = [max(step_s[n0:n1]) - typical, max(step_s[n1:]) - typical]
    held = int(r[-1]["leases_expired"]) - int(r[n1 - 1]["leases_expired"])
    print(f"\nstall after an abandoned lease: {stalls[0]:.2f} s; after kill -9 of a worker: {stalls[1]:.2f} s "
          f"(it held a lease: {held >= 1}); typical step {typical:.3f} s")
    assert r[-1]["step"] == "60" and max(stalls) < 10
    assert int(r[-1]["used"]) == 60 and int(r[-1]["dropped_stale"]) == 0                # only the dead batch lost
    done = (tmp_path / "worker0.log").read_text().split("exiting after ")[1]
    assert int(done.split()[0]) >= 1                                                # the late worker's batches were used


@pytest.mark.slow
def test_trainer_killed_and_resumed_keeps_workers_and_never_mixes_runs(tmp_path):
    """kill -9 the trainer, restart it with --resume on the same port: a new run id, version numbers reused
    with other weights. The workers carry on; batches of the dead run are refused (409); every step's
    logp_gap is exactly 0 (CartPole's MLP scores what it sampled bit for bit): no batch was scored
    against a snapshot of the other run."""
    port, csv_path = free_port(), tmp_path / "r.csv"
    args = ["--role", "trainer", "--serve-port", port, "--out", tmp_path / "r", "--solve-at", 0, "--eval-every", 0]
    ws, first, second = workers(port, 2, patience=30, tmp=tmp_path), None, None
    client = TrainerClient(f"http://127.0.0.1:{port}", TOKEN, patience=0)
    try:
        first = start(*args, "--steps", 40, "--ckpt-every", 3, log=tmp_path / "t1.log")
        wait_for_port(port)
        run1 = client.info()["run"]
        poll_rows(csv_path, lambda r: len(r) >= 7)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        second = start(*args, "--steps", 30, "--resume", tmp_path / "r.pt", log=tmp_path / "t2.log")
        version = wait_for_port(port)                                              # checkpoint step + 1: reused
        assert version >= 7 and version % 3 == 1 and client.info()["run"] != run1
        run2 = client.info()["run"]
        assert wait(second, 120) == 0, (tmp_path / "t2.log").read_text()[-3000:]
        assert [wait(w, 30) for w in ws] == [0, 0]      # the same processes, told by the second run it finished
        assert all(f"run {run2} finished" in (tmp_path / f"worker{i}.log").read_text() for i in range(2))
    finally:
        for w in ws + [first, second]:
            w and w.kill()
    r = rows(csv_path)
    assert [int(x["step"]) for x in r] == list(range(1, 31))                       # one CSV, continued
    assert all(float(x["logp_gap"]) == 0.0 for x in r)
    print(f"\nbatches of the killed run refused after the restart: {r[-1]['wrong_run']}")


def test_a_worker_reloads_when_the_run_changes_even_at_the_same_version(monkeypatch):
    """A --resume republishes version numbers with other weights. Trainer A serves W_a as version 1; it
    stops, and trainer B (a restart: a new run id) serves W_b, also as version 1, on the same port. The
    worker's batch for B must be sampled by W_b: its log-probs are W_b's, not W_a's."""
    from model import MLPPolicy
    monkeypatch.setenv("NANORL_TOKEN", TOKEN)
    port = free_port()
    cfg = Config(role="rollout", trainer_url=f"http://127.0.0.1:{port}", n_prompts=4, trainer_patience=2)
    task, policies = make_task(cfg), [MLPPolicy(4, 2, cfg.hidden) for _ in range(2)]     # W_a, W_b
    worker = threading.Thread(target=rollout_worker, args=(cfg, task, "1 thread"))
    for i, policy in enumerate(policies):
        server = TrainerServer(TOKEN, fingerprint(cfg, 4), 2, host="127.0.0.1", port=port,
                               limits=batch_limits(cfg, task, policy, 4)).start()
        server.publish(1, trainable(policy))
        if i == 0:
            worker.start()
        batch = server.next_batches(1, 1, timeout=30)[0]
        server.stop()
        a, b = (logprobs_no_grad(p, batch, 0) * batch.mask for p in policies)
        assert torch.allclose(batch.logp, (a, b)[i], atol=1e-6) and not torch.allclose(batch.logp, (b, a)[i], atol=1e-3)
    worker.join(30)
    assert not worker.is_alive()


def raise_fd_limit(need):
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"ulimit -n: the hard limit {hard} is under the {need} file descriptors this test needs")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


@pytest.mark.slow
def test_a_held_and_hostile_trainer_still_trains_to_its_last_step(tmp_path):
    """500 idle sockets, a client trickling a header line a second, and a hostile mix with and without the
    token (garbage, pickles, lying Content-Lengths, bad shapes, NaN, stale and future versions, batches the
    run cannot produce, leases never used) at a live trainer: one honest worker drives it to its last step."""
    raise_fd_limit(2048)                                # 500 sockets here; the trainer (inherits it) holds <= 256
    port, stop, marker = free_port(), threading.Event(), str(tmp_path / "unpickled")
    trainer = start("--role", "trainer", "--serve-port", port, "--out", tmp_path / "h", "--steps", 30,
                    "--solve-at", 0, "--eval-every", 0, log=tmp_path / "trainer.log")
    wait_for_port(port)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(500)]
    lying = socket.create_connection(("127.0.0.1", port))                           # says 1000 bytes, sends 10
    lying.sendall(f"POST /batch HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 1000\r\n\r\n"
                  "0123456789".encode())
    auth, statuses, ws = {"Authorization": f"Bearer {TOKEN}"}, [], []

    def trickle():
        while not stop.is_set():                        # cut at the trainer's 5 s header deadline: start over
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"POST /batch HTTP/1.1\r\n")
                while not stop.wait(1.0):
                    s.sendall(b"X-Slow: 1\r\n")

    def hostile():                                      # over and over while the worker trains
        with contextlib.suppress(OSError):
            while not stop.is_set():
                for p in ("/info", "/weights?version=1", "/lease?worker=a", "/renew?lease=x", "/batch"):
                    for h in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
                        statuses.extend([status_of(port, "POST", p, h, b"{}"), status_of(port, "GET", p, h)])
                statuses.extend(status_of(port, "POST", "/batch", auth, body) for body in bad_batches(marker))
                statuses.append(status_raw(port, {**auth, "Content-Length": "5"}, b"x" * 100))  # says 5, sends 100
                for v in (1, 10 ** 6):                  # stale (once training has moved on) and future
                    statuses.append(status_of(port, "POST", "/batch", auth, batch_to_bytes(
                        make_batch(version=v, N=L["n_prompts"] * L["group_size"], G=L["group_size"]), "x", info["run"])))
    try:
        sent = refused_by_a_live_trainer(port)          # group size, T, action ids, masks, rewards, ..
        client = TrainerClient(f"http://127.0.0.1:{port}", TOKEN, patience=0)
        info = client.info()
        L = info["limits"]
        nan = make_batch(N=L["n_prompts"] * L["group_size"], G=L["group_size"])
        nan.logp[0, 0] = float("nan")
        statuses.append(status_of(port, "POST", "/batch", auth, batch_to_bytes(nan, client.lease()[2], info["run"])))
        greedy = [status_of(port, "POST", "/lease?worker=greedy", auth, b"") for _ in range(3)]   # never used
        assert greedy == [200, 200, 429]                                            # 2 leases per worker at most
        for fn in (trickle, hostile):
            threading.Thread(target=fn, daemon=True).start()
        ws = workers(port, 1)
        assert wait(trainer, 240) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        stop.set()
        for w in ws + [trainer]:
            w.kill()
        for s in idle + [lying]:
            s.close()
    assert len(statuses) >= 150 and all(400 <= s < 500 for s in statuses), sorted(set(statuses))
    assert not os.path.exists(marker)
    last = rows(tmp_path / "h.csv")[-1]
    assert last["step"] == "30" and int(last["refused"]) >= sent + 1 and int(last["received"]) >= 30


class InThread(threading.Thread):
    """fn(*args) run in a thread, polled as a Popen is (poll(): None while it runs) -> .result, or .error."""

    def __init__(self, fn, *args):
        super().__init__(target=self.run_fn, args=(fn, *args), daemon=True)
        self.result = self.error = None
        self.start()

    def run_fn(self, fn, *args):
        try:
            self.result = fn(*args)
        except BaseException as e:                      # the test looks at it
            self.error = e

    def poll(self):
        return None if self.is_alive() else 0


def said(capsys, text, seen):
    """Wait until `text` is printed, by whichever thread (seen: what was read so far, grown) -> seen."""
    for _ in range(600):
        seen += capsys.readouterr().out
        if text in seen:
            return seen
        time.sleep(0.1)
    raise TimeoutError(f"never printed: {text!r}")


def test_a_worker_waits_for_its_trainer_trains_with_it_and_exits_when_the_run_ends(tmp_path, monkeypatch, capsys):
    """test_a_worker_says_it_waits_exits_when_the_run_ends_and_errs_in_one_line's first half, worker and
    trainer in threads of this process (the same train(), server and client, without starting interpreters):
    started first, the worker says it waits; it makes the trainer's batches; the trainer's 410 ends it."""
    monkeypatch.setenv("NANORL_TOKEN", TOKEN)
    port = free_port()
    worker = InThread(train, Config(role="rollout", trainer_url=f"http://127.0.0.1:{port}", trainer_patience=60))
    seen = said(capsys, "worker: waiting for the trainer at http://127.0.0.1:", "")
    trainer = InThread(train, Config(role="trainer", serve_port=port, out=str(tmp_path / "f"), steps=3,
                                     solve_at=0, eval_every=0, lease_timeout=2))   # finish(grace): 1 s
    trainer.join(120)
    worker.join(60)
    assert trainer.error is None and worker.error is None, (trainer.error, worker.error)
    seen = said(capsys, "exiting after", seen)
    assert re.search(r"worker: run \w+ finished.*; exiting after [1-9]\d* batches", seen), seen
    last = rows(tmp_path / "f.csv")[-1]
    assert last["step"] == "3" and int(last["used"]) == 3 and worker.result["batches"] >= 3


def test_a_worker_errs_in_one_line_alone_with_a_wrong_token_or_other_settings(monkeypatch):
    """test_a_worker_says_it_waits_exits_when_the_run_ends_and_errs_in_one_line's second half and
    test_worker_refuses_a_trainer_with_other_settings, in this process: no trainer, the wrong token and
    another MLP width are each one line naming the fix (__main__ prints it: test_cli, test_train)."""
    monkeypatch.setenv("NANORL_TOKEN", TOKEN)
    port = free_port()
    cfg = Config(role="rollout", trainer_url=f"http://127.0.0.1:{port}", n_prompts=4, trainer_patience=0.5)
    with pytest.raises(ValueError) as alone:
        train(cfg)
    assert str(alone.value) == (f"no trainer answered at http://127.0.0.1:{port} within --trainer-patience 0.5 "
                                f"s: start it first (--role trainer), or check the host and port it logged")
    task, policy = make_task(cfg), MLPPolicy(4, 2, cfg.hidden)
    server = TrainerServer(TOKEN, fingerprint(cfg, 4), 2, host="127.0.0.1", port=port,
                           limits=batch_limits(cfg, task, policy, 4)).start()
    try:
        server.publish(1, trainable(policy))
        with pytest.raises(ValueError) as other:
            rollout_worker(replace(cfg, hidden=32), task, "1 thread")
        assert "refusing to run: setting 'hidden': trainer 64, worker 32" in str(other.value)
        monkeypatch.setenv("NANORL_TOKEN", "another")
        with pytest.raises(ValueError) as wrong:
            train(cfg)
    finally:
        server.stop()
    assert str(wrong.value) == (f"the trainer at http://127.0.0.1:{port} refused this worker: wrong token: "
                                f"NANORL_TOKEN differs between trainer and worker")
    assert all("\n" not in str(e.value) for e in (alone, other, wrong))


def test_every_info_names_the_weights_even_one_asked_while_the_first_version_is_published(tmp_path, monkeypatch):
    """A worker checks the weights /info names (a vLLM worker: the first /info's against a later one's). A trainer
    that listened before its first publish answered with none, and a vLLM worker started beside it refused to run
    (CI). Here /info is asked while version 1 is being published (a worker's ask in that window), and once it
    answers: each answer is at version 1 and names the policy's weights."""
    monkeypatch.setenv("NANORL_TOKEN", TOKEN)
    port, answers, publish = free_port(), [], train_module.publish
    ask = TrainerClient(f"http://127.0.0.1:{port}", TOKEN, patience=0).info

    def publish_asked(*args):
        with contextlib.suppress(TrainerGone):      # not listening yet: nothing answers
            answers.append(ask())
        publish(*args)
    monkeypatch.setattr(train_module, "publish", publish_asked)
    trainer = InThread(train, Config(role="trainer", serve_port=port, out=str(tmp_path / "i"), steps=1, solve_at=0,
                                     eval_every=0, batch_timeout=2, ckpt_every=0))
    for _ in range(600):
        with contextlib.suppress(TrainerGone):
            answers.append(ask())
            break
        time.sleep(0.1)
    trainer.join(60)
    assert isinstance(trainer.error, TimeoutError), trainer.error      # no worker came: --batch-timeout
    names = {n: [list(shape), dtype] for n, (shape, dtype) in describe(trainable(MLPPolicy(4, 2, 64))).items()}
    assert answers and all(a["version"] == 1 and a["names"] == names for a in answers), answers


def test_a_trainer_without_batches_saves_and_says_how_to_resume_in_one_process(tmp_path, monkeypatch, capsys):
    """test_a_trainer_left_without_batches_saves_and_says_how_to_resume in this process, with no worker at all:
    after --batch-timeout the trainer saves and prints the command that resumes it, then raises the
    TimeoutError that __main__ prints as one line."""
    monkeypatch.setenv("NANORL_TOKEN", TOKEN)
    with pytest.raises(TimeoutError, match="^no worker batch within --batch-timeout 1 s: start workers"):
        train(Config(role="trainer", serve_port=free_port(), out=str(tmp_path / "t"), steps=1000, solve_at=0,
                     eval_every=0, batch_timeout=1, ckpt_every=0))
    assert torch.load(tmp_path / "t.pt")["step"] == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1].endswith(f"train.py --resume {tmp_path / 't.pt'}")


def test_behav_logprobs_swap_in_the_snapshot_and_restore_bit_for_bit():
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
    old = behav_logprobs(policy, batch, snaps.get(1), batch.micro_batches(2))
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
    with pytest.raises(ValueError, match="the trainer serves plain HTTP, not https"):   # it passed, then "gone"
        validate(Config(role="rollout", trainer_url="https://10.0.0.1:8471"))
    with pytest.raises(ValueError, match="--vllm is for --role rollout workers with --lora"):
        validate(Config(role="trainer", vllm=True))


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_trainer_left_without_batches_saves_and_says_how_to_resume(tmp_path):
    """kill -9 the only worker: after --batch-timeout the trainer saves, prints the command that resumes it, and
    exits 1 with one error line (it was a TimeoutError traceback and no checkpoint)."""
    port = free_port()
    trainer = start("--role", "trainer", "--serve-port", port, "--out", tmp_path / "t", "--steps", 1000,
                    "--solve-at", 0, "--eval-every", 0, "--batch-timeout", 3, "--ckpt-every", 0, log=tmp_path / "t.log")
    w = workers(port, 1)[0]
    try:
        poll_rows(tmp_path / "t.csv", lambda r: len(r) >= 3)
        w.send_signal(signal.SIGKILL)
        assert wait(trainer, 60) == 1
    finally:
        w.kill()
        trainer.kill()
    log = (tmp_path / "t.log").read_text()
    assert "Traceback" not in log and "error: no worker batch within --batch-timeout 3 s: start workers" in log
    step = torch.load(tmp_path / "t.pt")["step"]
    assert step == int(rows(tmp_path / "t.csv")[-1]["step"]) >= 3
    assert log.rstrip().splitlines()[-2] == f"    python train.py --resume {tmp_path / 't.pt'}", log[-500:]


@pytest.mark.slow
def test_a_worker_says_it_waits_exits_when_the_run_ends_and_errs_in_one_line(tmp_path):
    """Started before its trainer, a worker says so at once; when the trainer's run ends it hears so (410) and exits
    0 within seconds (not after --trainer-patience, 120 s); with no trainer, or the wrong token, one line and exit 1."""
    port = free_port()
    early = workers(port, 1, tmp=tmp_path, patience=120)[0]
    log = tmp_path / "worker0.log"
    for _ in range(600):                                # said at once, however slow the imports before it
        if "worker: waiting for the trainer at http://127.0.0.1:" in log.read_text():
            break
        time.sleep(0.1)
    assert "worker: waiting for the trainer at http://127.0.0.1:" in log.read_text()
    trainer = start("--role", "trainer", "--serve-port", port, "--out", tmp_path / "f", "--steps", 5,
                    "--solve-at", 0, "--eval-every", 0, log=tmp_path / "f.log")
    try:
        assert wait(trainer, 120) == 0, (tmp_path / "f.log").read_text()[-3000:]
        ended = time.time()
        assert wait(early, 60) == 0 and time.time() - ended < 20
    finally:
        early.kill()
        trainer.kill()
    assert re.search(r"worker: run \w+ finished.*; exiting after [1-9]\d* batches", (tmp_path / "worker0.log").read_text())
    alone = subprocess.run([sys.executable, "train.py", "--role", "rollout", "--trainer-url", f"http://127.0.0.1:{port}",
                            "--trainer-patience", "2"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert alone.returncode == 1 and "waiting for the trainer" in alone.stdout and alone.stderr.splitlines() == [
        f"error: no trainer answered at http://127.0.0.1:{port} within --trainer-patience 2 s: start it first "
        f"(--role trainer), or check the host and port it logged"]
    trainer = start("--role", "trainer", "--serve-port", port, "--out", tmp_path / "g", "--steps", 2,
                    "--batch-timeout", 30, "--eval-every", 0)
    try:
        wait_for_port(port)
        wrong = subprocess.run([sys.executable, "train.py", "--role", "rollout", "--trainer-url",
                                f"http://127.0.0.1:{port}"], cwd=ROOT, env={**ENV, "NANORL_TOKEN": "another"},
                               capture_output=True, text=True, timeout=60)
    finally:
        trainer.kill()
    assert wrong.returncode == 1 and wrong.stderr.splitlines() == [
        f"error: the trainer at http://127.0.0.1:{port} refused this worker: wrong token: NANORL_TOKEN differs "
        f"between trainer and worker"]


@pytest.mark.slow
def test_torchrun_trainer_ranks_each_take_a_batch_and_fail_together(tmp_path):
    port, master = free_port(), free_port()
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(master),
           "train.py", "--role", "trainer", "--serve-port", str(port), "--n-prompts", 8, "--solve-at", 0,
           "--eval-every", 0, "--batch-timeout", 5]
    trainer = subprocess.Popen([*map(str, run), "--steps", "6", "--out", str(tmp_path / "dp")], cwd=ROOT, env=ENV,
                               stdout=open(tmp_path / "t.log", "w"), stderr=subprocess.STDOUT)
    # workers once it listens (two ranks took over 10 s on a busy machine): a worker started beside it, between
    # tries 8 s apart, missed the whole run (CI) and waited out its patience; one that comes after the run's end
    # still does, so 20 s, not 120
    wait_for_port(port, 120)
    ws = workers(port, 2, tmp=tmp_path, patience=20)
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
    assert alone.returncode == 1 and time.time() - t0 < 60 and "raise TimeoutError" not in alone.stderr
    assert [x for x in alone.stderr.splitlines() if x.startswith("error: ")] == [   # rank 0's line, once
        "error: no worker batch within --batch-timeout 5 s: start workers (--role rollout --trainer-url "
        "http://THIS_HOST:PORT), or raise --batch-timeout"], alone.stderr
    assert f"torchrun --nproc_per_node=2 train.py --resume {tmp_path / 'alone.pt'}" in alone.stdout
    assert torch.load(tmp_path / "alone.pt")["step"] == 0                  # saved: nothing trained, nothing lost


def accepted_shape_batch(limits: dict, version: int, seed: int) -> Batch:
    """A control batch of random values anywhere the trainer's checks accept (its /info limits): any padded T,
    row lengths and truncation, observations and log-probs of any finite scale, rewards spread with signs over
    the masked steps, totalling within range (or, by rounding, just outside); now and then no final_states.
    An LLM run's limits (prompt_len > 0): accepted_token_batch."""
    if limits["prompt_len"]:
        return accepted_token_batch(limits, version, seed)
    g = torch.Generator().manual_seed(seed)
    pick = lambda options: options[int(torch.randint(len(options), (), generator=g))]
    G, P, L, A, O = (limits[k] for k in ("group_size", "n_prompts", "max_len", "n_actions", "obs_dim"))
    N, T, scales, (lo, hi) = G * P, pick([1, 2, 17, L]), [1e-30, 1.0, 1e3, 1e30], limits["reward"]
    mask = (torch.arange(T) < torch.randint(1, T + 1, (N, 1), generator=g)).float()      # [N, T]
    share, noise = torch.rand(N, T, generator=g) * mask, torch.randn(N, T, generator=g) * mask
    noise -= noise.sum(1, keepdim=True) / mask.sum(1, keepdim=True) * mask                # sums to ~0 per row
    total = lo + (hi - lo) * torch.rand(N, 1, generator=g)                                # [N, 1]
    return Batch(states=torch.randn(N, T, O, generator=g) * pick(scales),
                 actions=torch.randint(A, (N, T), generator=g),
                 logp=torch.randn(N, T, generator=g) * pick(scales), mask=mask,
                 rewards=total * share / share.sum(1, keepdim=True) + pick([0.0, 1.0, 1e3]) * noise,
                 truncated=torch.rand(N, generator=g) > 0.5,
                 final_states=pick([None, torch.randn(N, O, generator=g) * pick(scales)]), group_size=G,
                 version=version)


def accepted_token_batch(limits: dict, version: int, seed: int) -> Batch:
    """An LLM batch of random values anywhere the checks accept: prompts of 1..prompt_len ids and completions of
    1..max_len, any ids (padding too), log-probs of any finite scale, the reward on each row's last completion
    token, anywhere in range (or, by rounding, just outside), truncated or not."""
    g = torch.Generator().manual_seed(seed)
    N, L, A, (lo, hi) = limits["group_size"] * limits["n_prompts"], limits["max_len"], limits["n_actions"], \
        limits["reward"]
    prompt = torch.randint(1, limits["prompt_len"] + 1, (N,), generator=g)              # [N]
    end = prompt + torch.randint(1, L + 1, (N,), generator=g)                          # [N] past the completion
    T = int(end.max())
    pos = torch.arange(T)
    mask = ((pos >= prompt[:, None]) & (pos < end[:, None])).float()                   # [N, T]
    rewards = (pos == end[:, None] - 1) * (lo + (hi - lo) * torch.rand(N, 1, generator=g))
    ids = torch.randint(A, (N, T), generator=g)
    return Batch(states=ids, actions=ids.clone(), logp=-torch.rand(N, T, generator=g) * mask * [1e-30, 1, 1e30][seed % 3],
                 rewards=rewards, mask=mask, truncated=torch.rand(N, generator=g) > 0.5, final_states=None,
                 group_size=limits["group_size"], version=version)


def fuzz_until_done(port: int, trainer, first_seed: int) -> list:
    """Lease, submit accepted-shape batches until one is taken (a refused one leaves the lease held), repeat
    until the trainer is done -> the statuses: 200 (queued) or the refusals' codes."""
    client, statuses, seed = TrainerClient(f"http://127.0.0.1:{port}", TOKEN, patience=0), [], first_seed
    limits = client.info()["limits"]
    with contextlib.suppress(TrainerGone):
        while trainer.poll() is None:
            try:
                lease = client.lease(wait=5)
            except Rejected as e:                       # 410: the trainer said it finished
                assert e.status == 410, e
                break
            if lease is None:
                time.sleep(client.retry_after)
                continue
            run, version, lease_id = lease
            status = 0
            while status != 200 and status in (0, 400):
                seed += 1
                try:
                    client.submit(accepted_shape_batch(limits, version, seed), lease_id, run)
                    status = 200
                except Rejected as e:
                    status = e.status
                statuses.append(status)
    return [s for s in statuses if s != 410]            # 410: the trainer finished, the batch was not needed


@pytest.mark.slow
def test_every_estimator_trains_on_or_refuses_whatever_the_checks_accept(tmp_path, tiny_lm):
    """A live CartPole trainer per algorithm gets batches of random values anywhere the checks accept, some
    without final_states (PPO's critic bootstraps from them): each is refused with a 400 or trained on, and
    every trainer ends its steps with exit 0. Whatever the checks let in, the estimator and update can use.
    opd (LLM only): a tiny-LM trainer with the tiny LM as its teacher, given random token batches."""
    algos = ["reinforce", "reinforce_baseline", "ppo", "grpo", "rloo", "opd"]
    ports = [free_port() for _ in algos]
    llm = ["--task", "maxdigit", "--model", tiny_lm, "--teacher", tiny_lm, "--max-new-tokens", 4]
    trainers = [start("--role", "trainer", "--serve-port", port, "--out", tmp_path / algo, "--algo", algo,
                      "--steps", 6, "--n-prompts", 2, "--group-size", 2, "--eval-every", 0, "--solve-at", 0,
                      *(llm if algo == "opd" else []), log=tmp_path / f"{algo}.log")
                for algo, port in zip(algos, ports)]                                  # start up together
    statuses = []
    try:
        for i, (algo, port, trainer) in enumerate(zip(algos, ports, trainers)):
            wait_for_port(port)
            statuses += fuzz_until_done(port, trainer, 1000 * i)
            assert wait(trainer, 60) == 0, (tmp_path / f"{algo}.log").read_text()[-3000:]
            assert rows(tmp_path / f"{algo}.csv")[-1]["step"] == "6"
    finally:
        for trainer in trainers:
            trainer.kill()
    print(f"\n{statuses.count(200)} batches queued, {statuses.count(400)} refused")
    assert set(statuses) == {200, 400} and statuses.count(200) >= 6 * 6, statuses


def test_every_estimator_trains_on_or_refuses_whatever_the_checks_accept_in_one_process(tmp_path, monkeypatch,
                                                                                       tiny_lm):
    """test_every_estimator_trains_on_or_refuses_whatever_the_checks_accept with its six trainers in threads
    of this process: the same train(), server and checks, and the same fuzz."""
    monkeypatch.setenv("NANORL_TOKEN", TOKEN)
    algos = ["reinforce", "reinforce_baseline", "ppo", "grpo", "rloo", "opd"]
    ports = [free_port() for _ in algos]
    llm = dict(task="maxdigit", model=tiny_lm, teacher=tiny_lm, max_new_tokens=4)
    trainers = [InThread(train, Config(role="trainer", serve_port=port, out=str(tmp_path / algo), algo=algo,
                                       steps=6, n_prompts=2, group_size=2, eval_every=0, solve_at=0,
                                       lease_timeout=2, **(llm if algo == "opd" else {})))
                for algo, port in zip(algos, ports)]
    statuses = []
    for i, (algo, port, trainer) in enumerate(zip(algos, ports, trainers)):
        wait_for_port(port)
        statuses += fuzz_until_done(port, trainer, 1000 * i)
        trainer.join(60)
        assert not trainer.is_alive() and trainer.error is None, (algo, trainer.error)
        assert rows(tmp_path / f"{algo}.csv")[-1]["step"] == "6"
    assert set(statuses) == {200, 400} and statuses.count(200) >= 6 * 6, statuses


def flood(port: int, per_s: int, seconds: float, threads: int = 1, hold: float = 1.0) -> float:
    """Open per_s connections a second for `seconds` s from `threads` threads, each sending half a request
    without a token, held ~`hold` s and closed -> connections a second actually opened."""
    opened, tried, end = [0] * threads, [0] * threads, time.monotonic() + seconds

    def one(i):
        held, t0 = [], time.monotonic()
        while time.monotonic() < end:
            now = time.monotonic()
            while held and held[0][0] < now:
                held.pop(0)[1].close()
            for _ in range(min(int((now - t0) * per_s / threads) - tried[i], per_s // threads // 20 + 1)):
                tried[i] += 1
                with contextlib.suppress(OSError):
                    s = socket.create_connection(("127.0.0.1", port), timeout=1)
                    s.sendall(b"GET /info HTTP/1.1\r\nHost: 127.0.0.1\r\n")     # the rest never comes
                    held.append((now + hold, s))
                    opened[i] += 1
            time.sleep(0.002)
        for _, s in held:
            s.close()
    pool = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sum(opened) / seconds


def junk(port: int, conns: int, seconds: float) -> tuple:
    """`conns` connections at a time, each a request with a wrong token and then junk as fast as the trainer takes
    it; one cut is replaced at once -> (connections a second opened, MB a second sent). A 64 KiB send buffer: the
    flooder, on this machine too, copies little more than what the trainer reads (autotuned, ~1.5 MB a socket)."""
    head = b"POST /batch HTTP/1.1\r\nAuthorization: Bearer wrong\r\nContent-Length: 1000000000\r\n\r\n"
    sel, data, opened, sent = selectors.DefaultSelector(), b"x" * (1 << 16), 0, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        while len(sel.get_map()) < conns and time.monotonic() < end:
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=1)
            except OSError:                             # the accept queue is full: try again
                continue
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
                s.sendall(head)
                s.setblocking(False)
                sel.register(s, selectors.EVENT_WRITE)
                opened += 1
        for key, _ in sel.select(0.1):
            try:
                sent += key.fileobj.send(data)
            except OSError:                             # reset: the trainer cut it
                sel.unregister(key.fileobj)
                key.fileobj.close()
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    return opened / seconds, sent / seconds / 1e6


def steps_per_s(csv_path, seconds: float) -> float:
    n0, t0 = len(rows(csv_path)), time.monotonic()
    time.sleep(seconds)
    return (len(rows(csv_path)) - n0) / (time.monotonic() - t0)


def flood_figures(tmp_path, floods: list) -> list:
    """A live CartPole trainer with one honest worker: its steps/s alone for 10 s, then under each flood of 20 s
    (a function of the port -> what it reached) -> [steps/s alone, (reached, steps/s), ...]. Under each flood,
    a request that showed the token and sends its body slowly still gets its answer: it is never evicted."""
    raise_fd_limit(8192)
    port, csv_path = free_port(), tmp_path / "f.csv"
    # --lr 1e-9: the policy, so an episode's length and a step's cost, stays put for the whole measurement
    trainer = start("--role", "trainer", "--serve-port", port, "--out", tmp_path / "f", "--steps", 10 ** 6,
                    "--lr", 1e-9, "--solve-at", 0, "--eval-every", 0, log=tmp_path / "trainer.log")
    worker = workers(port, 1, tmp=tmp_path)[0]
    auth = f"POST /batch HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 20\r\n\r\n".encode()
    try:
        wait_for_port(port)
        poll_rows(csv_path, lambda r: len(r) >= 10)
        figures = [steps_per_s(csv_path, 10)]
        for fn in floods:
            slow, reached = socket.create_connection(("127.0.0.1", port), timeout=10), []
            slow.sendall(auth + b"0123456789")                                       # half its body
            flooder = threading.Thread(target=lambda: reached.append(fn(port)))
            flooder.start()
            figures.append(steps_per_s(csv_path, 19))
            flooder.join()
            slow.sendall(b"0123456789")                                             # the rest, 20 s later
            answer = slow.makefile("rb").readline()
            assert answer.startswith(b"HTTP/1.1 400 "), f"a request with the token was cut: {answer!r}"
            slow.close()
            figures[-1] = (reached[0], figures[-1])
            log = (tmp_path / "trainer.log").read_text()
            assert worker.poll() is None and trainer.poll() is None, log[-3000:]
    finally:
        for p in (worker, trainer):
            p.kill()
    return figures


@pytest.mark.slow
def test_a_connection_flood_keeps_the_trainer_training(tmp_path):
    """300 connections a second without a token, each half a request held ~1 s, for 20 s: they are capped
    among themselves, never at the cost of a connection that showed the token, so the worker keeps its
    long-polls and downloads and the trainer keeps at least 40% of its step rate."""
    alone, (reached, flooded) = flood_figures(tmp_path, [lambda port: flood(port, 300, 20)])
    print(f"\nsteps/s: {alone:.1f} alone, {flooded:.1f} under {reached:.0f} connections/s without a token")
    assert reached >= 200 and flooded >= 0.4 * alone


@pytest.mark.skipif(not os.environ.get("NANORL_BENCH_FLOOD"), reason="70 s: NANORL_BENCH_FLOOD=1 measures it")
def test_bench_flood_of_300_and_2000_connections_per_s(tmp_path):
    """Figures, not a pass/fail: 8 threads, as one reached ~1,600 connections/s at most here."""
    alone, *floods = flood_figures(tmp_path, [lambda port: flood(port, 300, 20),
                                              lambda port: flood(port, 2000, 20, threads=8)])
    under = "; ".join(f"{steps:.1f} under {rate:.0f} connections/s" for rate, steps in floods)
    print(f"\nsteps/s: {alone:.1f} alone; {under}")


@pytest.mark.skipif(not os.environ.get("NANORL_BENCH_FLOOD"), reason="~2.5 min: NANORL_BENCH_FLOOD=1 measures it")
def test_bench_junk_after_a_wrong_token(tmp_path):
    """Figures, not a pass/fail: 256 connections that send a wrong token, then stream junk (each replaced once
    cut), in three 20 s windows, each after 20 s without (the rate alone, in the same setting as the flood)."""
    figures = flood_figures(tmp_path, [lambda port: time.sleep(20), lambda port: junk(port, 256, 20)] * 3)
    alone, under = [figures[0]] + [f[1] for f in figures[1::2]], figures[2::2]
    spread = lambda xs: f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"
    print(f"\nsteps/s, median (min-max): {spread(alone)} alone; {spread([s for _, s in under])} under 256 junk "
          f"streams after a wrong token ({spread([r[0] for r, _ in under])} connections/s, "
          f"{spread([r[1] for r, _ in under])} MB/s sent)")
