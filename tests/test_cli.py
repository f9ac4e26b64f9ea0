"""A new user's first hour, as real processes: --help, what a run prints, Ctrl-C and --resume, run names
that never overwrite, one-line errors instead of tracebacks, and the plot command."""
import contextlib
import csv
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from tasks import MaxDigit, held_out
from test_dist import free_port
from test_train import ROOT
from train import Config, parse_config, train, validate

TRAIN, MODEL = os.path.join(ROOT, "train.py"), os.path.join(ROOT, "model.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run(*args, cwd, timeout=120, env=ENV):
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("script", [TRAIN, MODEL], ids=["train.py", "model.py"])
def test_help_prints_usage_and_creates_nothing(script, tmp_path):
    p = run(script, "--help", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage:") and "Traceback" not in p.stderr
    assert os.listdir(tmp_path) == []                                  # model.py --help once made a folder '--help'
    if script == TRAIN:                                                # the one command that is not a flag
        assert "python train.py --export RUN.pt DIR writes an LLM run as a Hugging Face folder" in " ".join(
            p.stdout.split())


def test_a_run_says_what_it_trains_and_where_its_files_go(tmp_path):
    p = run(TRAIN, "--steps", 3, "--solve-at", 0, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "reinforce on cartpole" in lines[0] and "1 thread (control task: 1 is fastest)" in lines[0]
    assert "runs/cartpole_reinforce.csv" in lines[1] and "runs/cartpole_reinforce.pt" in lines[1]
    assert lines[2].startswith("before training (step 0): eval_return ")   # the starting point, on screen too
    steps = [x for x in lines if x.startswith("step ")]
    assert [x.split()[1] for x in steps] == ["1/3", "2/3", "3/3"]
    assert all(len(x) <= 100 and "elapsed, eta" in x and "s/step" in x for x in steps), steps
    assert "python tests/plot.py runs/cartpole_reinforce.csv" in lines[-1]
    # the full metrics are in the CSV: every column, one row per step and the step-0 evaluation
    r = rows(tmp_path / "runs" / "cartpole_reinforce.csv")
    assert [x["step"] for x in r] == ["0", "1", "2", "3"] and r[1]["grad_norm"] and r[1]["entropy"]


@pytest.mark.slow
def test_runs_never_overwrite_each_other(tmp_path):
    for _ in range(2):
        assert run(TRAIN, "--steps", 1, "--solve-at", 0, cwd=tmp_path).returncode == 0
    assert sorted(os.listdir(tmp_path / "runs")) == ["cartpole_reinforce-2.csv", "cartpole_reinforce-2.pt",
                                                     "cartpole_reinforce.csv", "cartpole_reinforce.pt"]
    assert run(TRAIN, "--config", os.path.join(ROOT, "configs", "cartpole_ppo.yaml"), "--steps", 1, "--solve-at", 0,
               cwd=tmp_path).returncode == 0
    assert (tmp_path / "runs" / "cartpole_ppo.csv").exists()        # named after its config
    p = run(TRAIN, "--out", "runs/cartpole_ppo", "--steps", 1, cwd=tmp_path)   # an explicit name that exists
    assert p.returncode == 1 and "nothing is overwritten: continue that run with --resume runs/cartpole_ppo.pt" in p.stderr


def ctrl_c_mid_run(args, tmp_path):
    """Run train.py --out part, Ctrl-C it once its CSV has 8 rows -> (its stdout, the step saved). It exits 130
    without a traceback and prints the command that resumes it last."""
    p = subprocess.Popen([sys.executable, TRAIN, *map(str, args), "--out", "part"], cwd=tmp_path, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (os.path.exists(tmp_path / "part.csv") and len(rows(tmp_path / "part.csv")) >= 8):
        assert time.time() < deadline and p.poll() is None, "the run never got going"
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)                                       # Ctrl-C, mid-run
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err, err
    script = min(os.path.relpath(TRAIN, tmp_path), TRAIN, key=len)     # as train.py shortens it: the shorter
    assert out.splitlines()[-1] == f"    python {script} --resume part.pt"  # the exact command, printed last
    return out, torch.load(tmp_path / "part.pt")["step"]


@pytest.mark.slow
def test_ctrl_c_saves_and_the_printed_command_resumes_to_the_uninterrupted_weights(tmp_path):
    args = ["--steps", 40, "--n-prompts", 4, "--solve-at", 0, "--eval-every", 5]
    assert run(TRAIN, *args, "--out", "full", cwd=tmp_path).returncode == 0
    out, done = ctrl_c_mid_run(args, tmp_path)
    assert 7 <= done < 40
    r = run(*out.splitlines()[-1].split()[1:], cwd=tmp_path)         # that command, as printed
    assert r.returncode == 0, r.stderr
    a, b = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "part.pt")
    assert a["step"] == b["step"] == 40 and a["env_steps"] == b["env_steps"]
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"])
    full, part = rows(tmp_path / "full.csv"), rows(tmp_path / "part.csv")
    assert [x["step"] for x in part] == [str(i) for i in range(41)]    # each step once: no repeated rows
    assert [(x["reward"], x["eval_return"]) for x in part] == [(x["reward"], x["eval_return"]) for x in full]
    # resuming the finished run says so, instead of doing nothing
    again = run(TRAIN, "--resume", "part.pt", cwd=tmp_path)
    assert again.returncode == 1 and "that run is finished: it is at step 40 of --steps 40" in again.stderr
    assert "--steps above 40" in again.stderr and "writing" not in again.stdout   # no file announced, then an error


def test_runs_never_overwrite_each_other_in_one_process(tmp_path, monkeypatch):
    """test_runs_never_overwrite_each_other with the runs in this process (train(parse_config(argv)), what
    __main__ runs), not 4 interpreters."""
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        train(parse_config(["--steps", "1", "--solve-at", "0"]))
    assert sorted(os.listdir(tmp_path / "runs")) == ["cartpole_reinforce-2.csv", "cartpole_reinforce-2.pt",
                                                     "cartpole_reinforce.csv", "cartpole_reinforce.pt"]
    train(parse_config(["--config", os.path.join(ROOT, "configs", "cartpole_ppo.yaml"), "--steps", "1",
                        "--solve-at", "0"]))
    assert (tmp_path / "runs" / "cartpole_ppo.csv").exists()        # named after its config
    with pytest.raises(ValueError, match="nothing is overwritten: continue that run with --resume "
                                         "runs/cartpole_ppo.pt"):
        train(parse_config(["--out", "runs/cartpole_ppo", "--steps", "1"]))   # an explicit name that exists


def test_ctrl_c_saves_and_prints_the_command_that_resumes_it(tmp_path, monkeypatch):
    """test_ctrl_c_saves_and_the_printed_command_resumes_to_the_uninterrupted_weights with one process: Ctrl-C
    mid-run saves, exits 130 without a traceback and prints the resume command last, which continues the run
    (here in this process; that a resume reaches the uninterrupted weights: test_train)."""
    args = ["--steps", 1000, "--n-prompts", 4, "--solve-at", 0, "--eval-every", 5]
    out, done = ctrl_c_mid_run(args, tmp_path)
    assert 7 <= done < 1000
    assert [x["step"] for x in rows(tmp_path / "part.csv")] == [str(i) for i in range(done + 1)]
    monkeypatch.chdir(tmp_path)
    train(parse_config([*out.splitlines()[-1].split()[2:], "--steps", str(done + 2)]))   # that command, on
    assert [x["step"] for x in rows(tmp_path / "part.csv")] == [str(i) for i in range(done + 3)]


def children(pid):
    """The processes whose parent is pid (torchrun's ranks), from /proc."""
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{p}/stat") as f:
            found += [int(p)] if int(f.read().rsplit(")", 1)[1].split()[1]) == pid else []
    return found


def torchrun(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                             str(free_port()), TRAIN, *map(str, args)], env=ENV, text=True, **kw)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "full"
    assert torchrun(*DP_ARGS, "--eval-every", 0, "--out", out).wait(120) == 0
    return torch.load(f"{out}.pt")


DP_ARGS = ["--steps", 60, "--n-prompts", 16, "--solve-at", 0]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["one rank", "every process"])
@pytest.mark.parametrize("during", ["step", "evaluation"])
def test_ctrl_c_under_torchrun_stops_every_rank_together_and_resumes_exactly(tmp_path, uninterrupted, target, during):
    """SIGINT to one of 2 gloo ranks, or to torchrun and both ranks (a terminal's Ctrl-C; sky cancel sends
    SIGTERM alike), while they train or while they evaluate (64 episodes each step): the ranks agree at the
    step's end, rank 0 saves, and --resume reaches the weights of an uninterrupted run bit for bit."""
    evals = ["--eval-every", 1, "--eval-episodes", 64] if during == "evaluation" else ["--eval-every", 0]
    p = torchrun(*DP_ARGS, *evals, "--out", "part", cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 start_new_session=True)
    deadline = time.time() + 60
    while not (os.path.exists(tmp_path / "part.csv") and len(rows(tmp_path / "part.csv")) >= 4):
        assert time.time() < deadline and p.poll() is None, "the run never got going"
        time.sleep(0.02)
    if target == "one rank":
        os.kill(max(children(p.pid)), signal.SIGINT)
    else:
        os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert "torchrun --nproc_per_node=2" in out and "Traceback (most recent call last)" not in out, out + err
    done = torch.load(tmp_path / "part.pt")["step"]
    assert 3 <= done < 60
    assert torchrun("--resume", "part.pt", cwd=tmp_path, stdout=subprocess.DEVNULL).wait(120) == 0
    part = torch.load(tmp_path / "part.pt")
    assert part["step"] == uninterrupted["step"] == 60
    assert all(torch.equal(part["policy"][k], uninterrupted["policy"][k]) for k in part["policy"])


def checkout(path):
    """A copy of the seven modules at path -> its train module, imported under another name: the count of
    NanoRL processes a run from that checkout sees."""
    path.mkdir()
    for m in ("algos", "core", "utils", "serve", "tasks", "model", "train"):
        shutil.copy(os.path.join(ROOT, m + ".py"), path)
    spec = importlib.util.spec_from_file_location(f"train_{path.name}", path / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module                     # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_llm_processes_share_the_cores_and_control_takes_one_thread(tmp_path, monkeypatch):
    """Three processes on two cores with torch's default threads each ran 2-13x slower: an LLM process takes
    its share of the cores (recounted as NanoRL processes come and go), a control task 1 thread (the fastest
    for its 64-wide MLP), and --threads or OMP_NUM_THREADS override both. NanoRL processes are this
    checkout's train.py processes, real ones here (rollout workers waiting for a trainer): another
    checkout's and a foreign train.py (nanoGPT's, say) are not counted; one that exits, or is killed with
    -9, no longer is. Checkouts of their own, so that a suite running beside this one changes nothing."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    mine, theirs = checkout(tmp_path / "mine"), checkout(tmp_path / "theirs")
    (tmp_path / "train.py").write_text("import time\nprint('sleeping', flush=True)\ntime.sleep(60)\n")
    url = f"http://127.0.0.1:{free_port()}"           # nobody listens: the workers wait, asleep
    worker = ["--role", "rollout", "--trainer-url", url, "--trainer-patience", "60"]
    env = {**ENV, "NANORL_TOKEN": "cli-test"}
    procs = [subprocess.Popen([sys.executable, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
             for args in ([mine.__file__, *worker], [mine.__file__, *worker], [theirs.__file__, *worker],
                          [str(tmp_path / "train.py")])]
    cores, before = len(os.sched_getaffinity(0)), torch.get_num_threads()
    try:
        for p in procs:                                 # each said it waits (or sleeps): registered before
            assert p.stdout.readline().startswith(("worker: waiting for the trainer", "sleeping"))
        assert mine.nanorl_processes() == 2             # pytest itself runs no train.py
        assert (theirs.RUNNING / str(procs[2].pid)).exists() and theirs.nanorl_processes() == 1
        llm = mine.Config(task="maxdigit", model="m", algo="grpo", group_size=2)
        assert mine.share_cores(llm) == f"{max(1, cores // 2)} thread{'s' * (cores >= 4)} ({cores} cores / 2 " \
                                         f"NanoRL processes here)" and torch.get_num_threads() == max(1, cores // 2)
        assert mine.share_cores(mine.Config()) == "1 thread (control task: 1 is fastest)"
        assert torch.get_num_threads() == 1
        assert mine.share_cores(mine.Config(threads=3)) == "3 threads (--threads)" and torch.get_num_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert mine.share_cores(llm) == "2 threads (OMP_NUM_THREADS)"
        procs[0].send_signal(signal.SIGTERM)            # exits (130), taking its file along
        procs[1].kill()                                 # -9: its file stays, until the next count
        assert procs[0].wait(60) == 130 and procs[1].wait(60) == -signal.SIGKILL
        assert sorted(os.listdir(mine.RUNNING)) == [str(procs[1].pid)]
        assert mine.nanorl_processes() == 1 and os.listdir(mine.RUNNING) == []
    finally:
        for p in procs:
            p.kill()
            p.wait()
        torch.set_num_threads(before)
        for checkout_ in (mine, theirs):                # their folders in the temp dir, one per test run
            shutil.rmtree(checkout_.RUNNING, ignore_errors=True)


def one_line_error(p, expected):
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and expected in p.stderr, p.stderr


@pytest.mark.slow
def test_bad_files_give_one_line_errors(tmp_path):
    one_line_error(run(TRAIN, "--config", "nope.yaml", cwd=tmp_path), "error: --config nope.yaml: no such file")
    (tmp_path / "bad.yaml").write_text("algo: [grpo\nsteps: 3\n")
    one_line_error(run(TRAIN, "--config", "bad.yaml", cwd=tmp_path), "is not valid YAML at line 2")
    (tmp_path / "notes.pt").write_text("a text file, not a checkpoint\n")
    p = run(TRAIN, "--resume", "notes.pt", cwd=tmp_path)
    one_line_error(p, "--resume notes.pt is not a readable NanoRL checkpoint (not a torch zip file)")
    assert "weights_only" not in p.stderr                             # torch's advice would be unsafe here
    torch.save({"some": "other file"}, tmp_path / "other.pt")
    one_line_error(run(TRAIN, "--resume", "other.pt", cwd=tmp_path), "not saved by NanoRL")
    one_line_error(run("-O", TRAIN, "--resume", "other.pt", cwd=tmp_path), "not saved by NanoRL")   # no assert
    for offline in ("0", "1"):                                         # HF_HUB_OFFLINE=1: set on many clusters
        one_line_error(run(TRAIN, "--task", "maxdigit", "--algo", "grpo", "--group-size", 2, "--model",
                           "no/such/folder", cwd=tmp_path, env={**ENV, "HF_HUB_OFFLINE": offline}),
                       "--model no/such/folder: no local folder")


def test_a_taken_port_is_one_line_and_leaves_no_csv_to_resume(tmp_path):
    """Another process holds the port: one line naming it and the flag, not asyncio's 20-line traceback, and no
    run.csv (it once stayed, and the next run of --out run was told to --resume run.pt, which never existed)."""
    with socket.create_server(("0.0.0.0", 0)) as held:
        port = held.getsockname()[1]
        p = run(TRAIN, "--role", "trainer", "--serve-port", port, "--out", "run", "--steps", 1, cwd=tmp_path,
                env={**ENV, "NANORL_TOKEN": "t"})
    one_line_error(p, f"error: --serve-port {port}: cannot listen (")
    assert "address already in use): if the port is taken, pick another, or 0 for any free port" in p.stderr
    assert os.listdir(tmp_path) == []
    (tmp_path / "run.csv").write_text("step\n")                        # a CSV without its checkpoint
    with pytest.raises(ValueError, match=r"run.csv exist already, and nothing is overwritten: pick another --out"):
        validate(Config(out=str(tmp_path / "run")))
    (tmp_path / "run.pt").write_text("")                                # with one, the hint is to resume it
    with pytest.raises(ValueError, match=r"run.csv and \S+run.pt exist already, and nothing is overwritten: "
                                         r"continue that run with --resume \S+run.pt, or pick another --out"):
        validate(Config(out=str(tmp_path / "run")))


TYPOS = [("--confg", "--config"), ("--group_size", "--group-size"), ("--setps", "--steps")]


@pytest.mark.slow
@pytest.mark.parametrize("typo,fix", TYPOS)
def test_a_flag_typo_is_one_line_naming_the_flag_meant(tmp_path, typo, fix):
    one_line_error(run(TRAIN, typo, "2", cwd=tmp_path), f"error: unknown flag {typo}: did you mean {fix}?")
    one_line_error(run(TRAIN, "--steps", "ten", cwd=tmp_path), "argument --steps: invalid int value: 'ten'")


def test_bad_files_give_one_line_errors_in_one_process(tmp_path, monkeypatch):
    """test_bad_files_give_one_line_errors in this process: each is a one-line ValueError, which __main__
    prints as `error: ...` and exits 1 (test_train: test_cli_prints_the_error_not_a_traceback)."""
    monkeypatch.chdir(tmp_path)

    def error(*argv):
        with pytest.raises(ValueError) as e:
            train(parse_config(list(map(str, argv))))
        assert "\n" not in str(e.value)
        return str(e.value)
    assert error("--config", "nope.yaml").startswith("--config nope.yaml: no such file")
    (tmp_path / "bad.yaml").write_text("algo: [grpo\nsteps: 3\n")
    assert "is not valid YAML at line 2" in error("--config", "bad.yaml")
    (tmp_path / "notes.pt").write_text("a text file, not a checkpoint\n")
    why = error("--resume", "notes.pt")
    assert "--resume notes.pt is not a readable NanoRL checkpoint (not a torch zip file)" in why
    assert "weights_only" not in why                                  # torch's advice would be unsafe here
    torch.save({"some": "other file"}, tmp_path / "other.pt")
    assert "not saved by NanoRL" in error("--resume", "other.pt")
    for offline in ("0", "1"):                                         # HF_HUB_OFFLINE=1: set on many clusters
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
        assert "--model no/such/folder: no local folder" in error("--task", "maxdigit", "--algo", "grpo",
                                                                   "--group-size", 2, "--model", "no/such/folder")


@pytest.mark.parametrize("typo,fix", TYPOS)
def test_a_flag_typo_is_one_line_naming_the_flag_meant_in_one_process(typo, fix):
    with pytest.raises(ValueError) as e:
        parse_config([typo, "2"])
    assert str(e.value).startswith(f"unknown flag {typo}: did you mean {fix}?") and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="argument --steps: invalid int value: 'ten'"):
        parse_config(["--steps", "ten"])


def test_resume_may_change_what_leaves_the_maths_alone_and_nothing_else_in_one_process(tmp_path, monkeypatch,
                                                                                      capsys):
    monkeypatch.chdir(tmp_path)
    train(parse_config(["--steps", "2", "--n-prompts", "4", "--solve-at", "0", "--out", "r"]))
    with pytest.raises(ValueError, match=r"these differ \(checkpoint, now\): --lr 0.01 vs 0.1"):
        train(parse_config(["--resume", "r.pt", "--steps", "4", "--lr", "0.1"]))
    capsys.readouterr()
    train(parse_config(["--resume", "r.pt", "--steps", "3", "--micro-batch", "2", "--threads", "1", "--serve-port",
                        "0", "--batch-timeout", "9", "--lease-timeout", "2", "--grad-ckpt", "--gen-batch", "8"]))
    assert "resuming r.pt after step 2" in capsys.readouterr().out


@pytest.mark.slow
def test_resume_may_change_what_leaves_the_maths_alone_and_nothing_else(tmp_path):
    assert run(TRAIN, "--steps", 2, "--n-prompts", 4, "--solve-at", 0, "--out", "r", cwd=tmp_path).returncode == 0
    one_line_error(run(TRAIN, "--resume", "r.pt", "--steps", 4, "--lr", 0.1, cwd=tmp_path),
                   "these differ (checkpoint, now): --lr 0.01 vs 0.1")
    p = run(TRAIN, "--resume", "r.pt", "--steps", 3, "--micro-batch", 2, "--threads", 1, "--serve-port", 0,
            "--batch-timeout", 9, "--lease-timeout", 2, "--grad-ckpt", "--gen-batch", 8, cwd=tmp_path)
    assert p.returncode == 0 and "resuming r.pt after step 2" in p.stdout, p.stderr


@pytest.mark.slow
def test_torchrun_prints_a_user_error_once_and_names_it_in_its_summary(tmp_path):
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                        str(free_port()), TRAIN, "--algo", "grpo"], cwd=tmp_path, env=ENV, capture_output=True,
                       text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert [x for x in out.splitlines() if x.startswith("error:")] == [
        "error: --algo grpo needs --group-size >= 2 (a group of one is its own baseline, so every advantage is 0): "
        "use --group-size 8, or --algo reinforce"]
    assert "traceback : error: --algo grpo needs --group-size >= 2" in out  # torchrun's root cause, not a link


def test_maxdigit_holds_out_distinct_problems_and_always_9_scores_27_percent():
    task = MaxDigit(eval_episodes=100)
    prompts = [p["prompt"] for p in task.eval_set]
    assert len(prompts) == len(set(prompts)) == 100 and all(held_out(p) for p in prompts)
    assert sum(p["answer"] == "9" for p in task.eval_set) == 27       # the README's baseline, counted on this set


@pytest.mark.slow
def test_maxdigit_holds_out_a_tenth_of_its_1000_prompts():
    assert len(MaxDigit(eval_episodes=1000).eval_set) == 107          # all of 1,000 prompts' held-out tenth


def test_a_tiny_held_out_split_warns(tmp_path, capsys):
    from tasks import GSM8K
    data = tmp_path / "g.jsonl"
    data.write_text("".join(f'{{"question": "What is {i} + 1?", "answer": "#### {i + 1}"}}\n' for i in range(30)))
    task = GSM8K(eval_episodes=16, data=str(data))
    assert len(task.eval_set) < 20
    assert f"warning: only {len(task.eval_set)} held-out problems" in capsys.readouterr().err


def test_llm_discounting_and_fp16_training_are_refused(monkeypatch):
    monkeypatch.setenv("NANORL_TOKEN", "t")
    llm = dict(task="maxdigit", model="gpt2", algo="reinforce")
    with pytest.raises(ValueError, match=r"--gamma 0.99 would discount LLM tokens .* use --gamma 1"):
        validate(Config(**llm))
    validate(Config(**llm, gamma=1.0))
    with pytest.raises(ValueError, match="--dtype float16 would train without loss scaling"):
        validate(Config(**llm, gamma=1.0, dtype="float16"))
    validate(Config(**llm, gamma=1.0, dtype="float16", role="rollout", trainer_url="http://127.0.0.1:1"))


@pytest.mark.slow
def test_plot_writes_a_png_of_your_run_or_says_matplotlib_is_missing(tmp_path):
    assert run(TRAIN, "--steps", 2, "--solve-at", 0, "--out", "r", cwd=tmp_path).returncode == 0
    no_mpl = "import runpy, sys; sys.modules['matplotlib'] = None; runpy.run_path(sys.argv[1], run_name='__main__')"
    p = run("-c", no_mpl, os.path.join(ROOT, "tests", "plot.py"), "r.csv", cwd=tmp_path)
    assert p.returncode == 1 and p.stderr.strip() == "error: plotting needs matplotlib, an optional extra: " \
                                                     "pip install matplotlib"
    pytest.importorskip("matplotlib", reason="the PNG itself needs: pip install matplotlib")
    p = run(os.path.join(ROOT, "tests", "plot.py"), "r.csv", cwd=tmp_path)
    assert p.returncode == 0 and (tmp_path / "r.png").stat().st_size > 10_000, p.stderr
