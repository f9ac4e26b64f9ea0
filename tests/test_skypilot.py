"""skypilot/*.yaml: headers, the token, per-role installs, every train.py line through validate(), and a
local rehearsal of the run scripts. A cloud cannot run here, so the rehearsal is the closest honest
thing: the files' own `run:` scripts under bash, with the SKYPILOT_* variables set as SkyPilot sets
them, two "nodes" as two process trees on loopback, the tiny CPU model and HF workers via the envs.
(SkyPilot's own parser: test_skypilot_parse.py, in its own venv.)"""
import contextlib
import csv
import glob
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import yaml

from test_dist import free_port
from test_train import ROOT
from train import fingerprint, parse_config, validate

FILES = sorted(glob.glob(os.path.join(ROOT, "skypilot", "*.yaml")))
TOKEN = "rehearsal-token"
# Shell variables the run scripts get at run time, as a 2-node cluster would have them.
RUNTIME = {"HEAD": "10.0.0.1", "SKYPILOT_JOBGROUP_NAME": "nanorl-countdown"}


def tasks(path):
    """The task documents of a file (a job group's header, which has no run, left out)."""
    docs = [d for d in yaml.safe_load_all(open(path)) if d and "run" in d]
    for d in docs:                                                   # as SkyPilot reads them: STEPS: 60 is "60"
        d["envs"] = {k: str(v) for k, v in d.get("envs", {}).items()}
    return docs


def task(name, index=0):
    return tasks(os.path.join(ROOT, "skypilot", name))[index]


def gpus_per_node(t):
    acc = t["resources"]["accelerators"]                             # "H100:8", or any of {L4: 2, A100: 2}
    counts = set(acc.values()) if isinstance(acc, dict) else {int(acc.split(":")[1])}
    assert len(counts) == 1, acc
    return counts.pop()


def train_lines(t):
    """Every train.py command line of a task's run script, with its envs substituted:
    -> [(argv after train.py, world size)]. World size from torchrun's --nproc_per_node, else 1."""
    env = {**t["envs"], **RUNTIME, "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus_per_node(t))}
    out = []
    for line in t["run"].replace("\\\n", " ").splitlines():
        if "train.py" not in line:
            continue
        launcher, args = line.split("train.py", 1)
        args = re.split(r"\s(?:>|&|\||;)", args)[0]                  # up to a redirect or a '&'
        sub = lambda s: re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], s)  # KeyError: a variable we don't know
        nproc = re.search(r"--nproc_per_node[= ](\S+)", launcher)
        out.append((shlex.split(sub(args)), int(sub(nproc.group(1))) if nproc else 1))
    return out


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_header_says_what_hardware_how_to_launch_and_watch(path):
    head = []
    for line in open(path):
        if not line.startswith("#"):
            break
        head.append(line)
    text = "".join(head)
    launch = "sky jobs launch" if "execution: parallel" in open(path).read() else "sky launch"
    assert len(head) >= 6 and "Hardware" in text and "Watch" in text, text
    assert f"{launch} " in text and f"skypilot/{os.path.basename(path)}" in text, "the exact launch command"
    assert "sky logs" in text or "sky jobs logs" in text


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_the_token_is_a_secret_never_a_literal(path):
    text = open(path).read()
    assert not re.search(r"NANORL_TOKEN\s*[=:]\s*(?!null\b)['\"]?\w", text), "a literal token"
    for t in tasks(path):
        assert "NANORL_TOKEN" not in t["envs"]
        if "--role" in t["run"]:
            assert t["secrets"] == {"NANORL_TOKEN": None}
            assert "--secret NANORL_TOKEN" in text


def test_vllm_is_installed_only_where_it_generates():
    for t in tasks(os.path.join(ROOT, "skypilot", "countdown_jobgroup.yaml")) + [task("gsm8k_1gpu.yaml")]:
        assert ("vllm==0.33.0" in t["setup"]) == ("--vllm" in t["envs"].get("WORKER_ARGS", "")), t["name"]
        assert "-r requirements-llm.txt" in t["setup"]
    assert "vllm==0.33.0 -r requirements-llm.txt" in task("gsm8k_2gpu_async.yaml")["setup"]   # both roles, 1 node


def test_countdown_setup_gives_the_trainer_node_no_vllm(tmp_path):
    """Runs countdown.yaml's setup as node 0 and node 1. pip and hf are stand-ins that only record their
    arguments: installing vLLM needs CUDA and gigabytes, which this machine has not."""
    for tool in ("pip", "hf"):
        (tmp_path / tool).write_text(f'#!/bin/sh\necho {tool} "$@" >> "$RECORD"\n')
        (tmp_path / tool).chmod(0o755)
    installed = {}
    for rank in (0, 1):
        record = tmp_path / f"node{rank}.txt"
        env = {**os.environ, **task("countdown.yaml")["envs"], "PATH": f"{tmp_path}:{os.environ['PATH']}",
               "RECORD": str(record), "SKYPILOT_SETUP_NODE_RANK": str(rank)}
        subprocess.run(["bash", "-c", task("countdown.yaml")["setup"]], cwd=ROOT, env=env, check=True)
        installed[rank] = record.read_text()
    assert "torch==2.14.0 -r requirements-llm.txt" in installed[0] and "vllm" not in installed[0]
    assert "vllm==0.33.0 -r requirements-llm.txt" in installed[1]
    assert all("hf download Qwen/Qwen3-8B" in installed[r] for r in (0, 1))


def test_requirements_llm_admits_the_transformers_vllm_pins():
    """vLLM 0.33.0 pins transformers>=5.16.1,<5.21: the workers' one pip line must be satisfiable."""
    from packaging.requirements import Requirement
    req = next(Requirement(line.split("#")[0].strip()) for line in open(os.path.join(ROOT, "requirements-llm.txt"))
               if line.startswith("transformers"))
    assert any(req.specifier.contains(v) for v in ("5.16.1", "5.17.0", "5.18.0", "5.19.0", "5.20.0")), \
        f"requirements-llm.txt has {req}; vllm==0.33.0 needs transformers>=5.16.1,<5.21"


def test_requirements_admit_every_torch_the_install_lines_pin():
    """Every torch==X a launch file, the README or CI installs (2.14.0 on the GPU nodes: vLLM 0.33's pin) is in
    requirements.txt's range: one outside it makes that pip line unsatisfiable (`torch>=2.11,<2.14` did)."""
    from packaging.requirements import Requirement
    req = next(Requirement(line.split("#")[0].strip()) for line in open(os.path.join(ROOT, "requirements.txt"))
               if line.startswith("torch"))
    texts = [open(f).read() for f in [*FILES, os.path.join(ROOT, "README.md"), os.path.join(ROOT, ".ci", "run")]]
    pins = set(re.findall(r"torch==([0-9.]+[0-9])", "".join(texts)))
    assert {"2.11.0", "2.13.0", "2.14.0"} <= pins and all(req.specifier.contains(v) for v in pins), (req, pins)


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_every_train_py_line_passes_validate_and_the_roles_agree(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("NANORL_TOKEN", TOKEN)
    cfgs = {}
    for t in tasks(path):
        for argv, world in train_lines(t):
            cfg = parse_config(argv)
            validate(cfg, world)
            cfgs.setdefault(cfg.role, []).append((cfg, world))
    assert set(cfgs) in ({"sync"}, {"trainer", "rollout"}), set(cfgs)
    if "trainer" in cfgs:
        (trainer, world), = cfgs["trainer"]
        for worker, _ in cfgs["rollout"]:          # what the worker checks at start-up, and the address
            assert fingerprint(worker, 0) == fingerprint(trainer, 0)
            assert worker.trainer_url.endswith(f":{trainer.serve_port}") and worker.vllm


# ---- the rehearsal: the run scripts on this machine ----

@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    pytest.importorskip("transformers", reason="the LLM path needs: pip install -r requirements-llm.txt")
    from model import make_tiny_lm
    return make_tiny_lm(str(tmp_path_factory.mktemp("tiny")), chars=[chr(i) for i in range(32, 127)])


def node(t, log, overrides, **skypilot):
    """One node: the task's run script under bash, its envs exported and overridden the way
    `sky launch --env` does, plus what SkyPilot sets on every node. Its own session: a process tree."""
    env = {**os.environ, **t["envs"], **overrides, **{f"SKYPILOT_{k.upper()}": str(v) for k, v in skypilot.items()},
           "NANORL_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}    # python, torchrun
    return subprocess.Popen(["bash", "-c", t["run"]], cwd=ROOT, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def finish(nodes, timeout):
    """Exit codes of every node. A node still running at the deadline, or one that failed (its script may
    have left a worker behind), is killed with its whole tree: its session, started by node()."""
    deadline, codes = time.time() + timeout, []
    try:
        for p in nodes:
            codes.append(p.wait(max(1.0, deadline - time.time())))
    finally:
        for p in nodes:
            if p.poll() != 0:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return codes


def small(tiny_lm, tmp_path, steps=3, **extra):
    """Overrides for a few-second run: the tiny model, HF workers (WORKER_ARGS without --vllm) that
    notice within 3 s that the trainer is gone, and small batches for both roles."""
    args = "--n-prompts 4 --group-size 2 --max-new-tokens 4 --eval-every 0 --gen-batch 8 --micro-batch 4 " \
           "--batch-timeout 60 " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in extra.items())
    return {"MODEL": tiny_lm, "STEPS": str(steps), "OUT": str(tmp_path / "run"), "PORT": str(free_port()),
            "WORKER_ARGS": "--trainer-patience 3", "EXTRA_ARGS": args}


def used(tmp_path):
    rows = list(csv.DictReader(open(tmp_path / "run.csv")))
    return [int(r["step"]) for r in rows], int(rows[-1]["used"])


@pytest.mark.slow
def test_rehearsal_countdown_two_nodes_on_loopback(tmp_path, tiny_lm):
    """countdown.yaml as 2 nodes x 2 "GPUs": node 0 runs torchrun with 2 trainer ranks, node 1 two HF
    workers that find the trainer through the head of SKYPILOT_NODE_IPS (both loopback addresses, but
    different ones, so the worker's log shows which line it took)."""
    t, env = task("countdown.yaml"), small(tiny_lm, tmp_path)
    common = dict(node_ips="127.0.0.1\n127.0.0.2", num_nodes=2, num_gpus_per_node=2, task_id="sky-rehearsal_nanorl")
    nodes = [node(t, tmp_path / f"node{r}.log", env, node_rank=r, **common) for r in (0, 1)]
    codes = finish(nodes, 150)
    logs = [(tmp_path / f"node{r}.log").read_text() for r in (0, 1)]
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert f"trainer: serving on 0.0.0.0:{env['PORT']}" in logs[0]
    steps, n_used = used(tmp_path)
    assert steps == [1, 2, 3] and n_used == 3 * 2                   # one worker batch per rank per step
    for i in (0, 1):      # one worker per GPU, each exited when told the run finished; a worker that took 7.4 s to
        w = (tmp_path / f"run.worker{i}.log").read_text()        # load (a slower machine) may have had no batch in,
        # or heard it at its settings check, before its "worker: URL, ..." line (CI): the URL is in its first line
        assert f"waiting for the trainer at http://127.0.0.1:{env['PORT']} " in w, w
        assert re.search(r"exiting after \d+ batches", w), w


@pytest.mark.slow
def test_rehearsal_gsm8k_2gpu_async_one_node(tmp_path, tiny_lm):
    """gsm8k_2gpu_async.yaml: the trainer ("GPU 0") and one HF worker ("GPU 1") on one node."""
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(f'{{"question": "What is {i} + 1?", "answer": "{i} + 1 = {i + 1}\\n#### {i + 1}"}}\n'
                            for i in range(40)))
    env = small(tiny_lm, tmp_path, data=data)
    codes = finish([node(task("gsm8k_2gpu_async.yaml"), tmp_path / "node0.log", env, node_rank=0, num_nodes=1,
                         node_ips="127.0.0.1", num_gpus_per_node=2, task_id="sky-rehearsal_2gpu")], 120)
    assert codes == [0], (tmp_path / "node0.log").read_text()[-3000:]
    assert used(tmp_path) == ([1, 2, 3], 3)
    assert re.search(r"exiting after [1-9]\d* batches", (tmp_path / "run.worker.log").read_text())
