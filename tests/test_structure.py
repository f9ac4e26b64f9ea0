"""The import graph stays one-way (the README's layout), and CartPole and every preset in configs/ run, a fork's
too. The size ratchet, the README's line counts and the shipped presets' headers are the maintainers' (python
tests/house.py, in .ci/run), not a fork's red test."""
import ast
import csv
import glob
import os
import subprocess
import sys

import pytest

from test_train import ROOT

MODULES = ["core", "utils", "algos", "model", "tasks", "serve", "train"]
ALLOWED = {"core": set(), "utils": set(), "algos": {"core", "utils"}, "model": {"core", "utils"},
           "tasks": {"core", "utils"}, "serve": {"core", "utils"}, "train": set(MODULES) - {"train"}}
HEAVY = {"transformers", "peft", "vllm", "datasets"}  # imported inside the functions that need them


def imports(name):
    tree = ast.parse(open(os.path.join(ROOT, name + ".py")).read())
    top, anywhere = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = {a.name.split(".")[0] for a in node.names} if isinstance(node, ast.Import) else {
                (node.module or "").split(".")[0]}
            anywhere |= mods
            if node.col_offset == 0:
                top |= mods
    return top, anywhere


@pytest.mark.parametrize("name", MODULES)
def test_imports_point_one_way(name):
    top, anywhere = imports(name)
    assert anywhere & set(MODULES) <= ALLOWED[name], f"{name} imports {anywhere & set(MODULES) - ALLOWED[name]}"
    assert not top & HEAVY, f"{name} imports {top & HEAVY} at module level: import inside the function"


def test_cartpole_never_imports_the_llm_stack(tmp_path):
    code = "import train, sys; train.train(train.Config(steps=1, n_prompts=2, out=sys.argv[1], solve_at=0)); " \
           "print(sorted(m for m in ('transformers', 'peft', 'vllm', 'yaml') if m in sys.modules))"
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]"


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory):
    pytest.importorskip("transformers", reason="LLM configs need: pip install -r requirements-llm.txt")
    from model import make_tiny_lm
    return make_tiny_lm(str(tmp_path_factory.mktemp("tiny")), chars=[chr(i) for i in range(32, 127)])


@pytest.fixture(scope="session")
def digits_lm(tmp_path_factory):
    """The tiny LM of 16 ids (digits, ' ', '=', ','): a random one ends its turn about every 16 tokens."""
    pytest.importorskip("transformers", reason="LLM configs need: pip install -r requirements-llm.txt")
    from model import make_tiny_lm
    return make_tiny_lm(str(tmp_path_factory.mktemp("digits")))


CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def gsm8k_file(tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(f'{{"question": "What is {i} + 1?", "answer": "{i} + 1 = {i + 1}\\n#### {i + 1}"}}\n'
                            for i in range(40)))
    return str(data)


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_config_smoke_runs_in_this_process(path, tmp_path, request, capsys):
    """test_every_config_smoke_runs for the fast tier: in this process (train(parse_config(argv)), what
    __main__ runs) and a smaller budget still (LLM presets: 2 prompts x 2 samples of 2 tokens, 1 step,
    evaluated on 2 problems); LoRA, dtype, checkpointing, task and algorithm as the preset says."""
    import torch
    import train
    args = ["--steps", "1", "--solve-at", "0", "--out", str(tmp_path / "smoke"), "--eval-every", "1"]
    turns = "max_turns:" in open(path).read()
    if turns:       # turns must happen: the digits LM ends a turn every ~16 tokens, and its budget holds the
        args += ["--model", request.getfixturevalue("digits_lm"), "--n-prompts", "8", "--group-size", "2",
                 "--max-new-tokens", "96", "--eval-episodes", "2", "--micro-batch", "4"]   # user turn's ~40 ids
    elif "task: cartpole" not in open(path).read():
        args += ["--model", request.getfixturevalue("tiny_lm"), "--n-prompts", "2", "--group-size", "2",
                 "--max-new-tokens", "2", "--eval-episodes", "2", "--gen-batch", "8", "--micro-batch", "2"]
    if "task: cartpole" not in open(path).read():
        if "task: gsm8k" in open(path).read():
            args += ["--data", gsm8k_file(tmp_path)]
        if "teacher:" in open(path).read():            # the tiny LM as its own teacher: same vocabulary
            args += ["--teacher", request.getfixturevalue("tiny_lm")]
    threads = torch.get_num_threads()
    try:
        train.train(train.parse_config(["--config", path, *args]))
    finally:
        torch.set_num_threads(threads)                  # share_cores' choice for the preset: not the next test's
    assert len((tmp_path / "smoke.csv").read_text().splitlines()) == 3          # header, step 0 eval, 1 step
    assert "before training (step 0)" in capsys.readouterr().out
    if turns:
        with open(tmp_path / "smoke.csv", newline="") as f:
            assert float(list(csv.DictReader(f))[-1]["turns"]) > 1                # the environment answered


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_config_smoke_runs(path, tmp_path, request):
    """Every preset, 2 steps. LLM presets run on the tiny LM (no hub here) with a small budget,
    everything else (LoRA, dtype, checkpointing, task, algorithm) as the preset says."""
    args = ["--steps", "2", "--solve-at", "0", "--out", str(tmp_path / "smoke"), "--eval-every", "1"]
    if "task: cartpole" not in open(path).read():
        args += ["--model", request.getfixturevalue("tiny_lm"), "--n-prompts", "2", "--max-new-tokens", "4",
                 "--eval-episodes", "2", "--gen-batch", "8", "--micro-batch", "4"]
        if "task: gsm8k" in open(path).read():
            args += ["--data", gsm8k_file(tmp_path)]
        if "teacher:" in open(path).read():            # the tiny LM as its own teacher: same vocabulary
            args += ["--teacher", request.getfixturevalue("tiny_lm")]
    p = subprocess.run([sys.executable, "train.py", "--config", path, *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert len((tmp_path / "smoke.csv").read_text().splitlines()) == 4          # header, step 0 eval, 2 steps


FORK_TASK = '''

class Reverse(LLMTask):
    """'123=' -> '321': a fork's first task, the digits reversed."""
    rewards = [(1.0, lambda prompt, completion, answer: float(completion.startswith(answer)))]

    def problem(self, rng):
        digits = "".join(map(str, rng.integers(0, 10, size=3).tolist()))
        return {"prompt": digits + "=", "answer": digits[::-1]}


TASKS["reverse"] = Reverse
'''
FORK_CONFIG = "task: reverse\nmodel: runs/tiny-lm\nalgo: grpo\ngroup_size: 4\nn_prompts: 8\nmax_new_tokens: 3\n"


@pytest.mark.slow
def test_a_forks_first_config_and_task_keep_the_suite_green(tmp_path):
    """As a new user forks: this checkout's files, a 12-line task added to tasks.py and a preset with no header
    that the README does not show added to configs/. The fast tier passes there, the new preset smoke-run with
    the others; only house.py, this project's own rules (.ci/run), names what a maintainer would add."""
    fork = tmp_path / "fork"
    for name in subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split():
        os.makedirs(fork / os.path.dirname(name), exist_ok=True)
        with open(os.path.join(ROOT, name), "rb") as src, open(fork / name, "wb") as dst:
            dst.write(src.read())
    with open(fork / "tasks.py", "a") as f:
        f.write(FORK_TASK)
    (fork / "configs" / "my_reverse.yaml").write_text(FORK_CONFIG)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "tests", "-p", "no:cacheprovider"], cwd=fork,
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:]
    assert "PASSED tests/test_structure.py::test_every_config_smoke_runs_in_this_process[my_reverse.yaml]" in p.stdout
    house = subprocess.run([sys.executable, "tests/house.py"], cwd=fork, capture_output=True, text=True)
    assert house.returncode == 1 and "README never shows configs/my_reverse.yaml" in house.stderr
    assert "configs/my_reverse.yaml's header" in house.stderr
