"""tests/gpu_check.py has not run on a GPU yet; its --cpu rehearsal runs the same code path (real train.py
processes, the per-step CSV columns it reads, the trainer + worker pair, the table it prints) on tiny shapes, so
that the day a GPU is lent it works the first time."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ["smollm2 bf16 step", "0.5B-shaped bf16 step", "0.5B-shaped bf16 step, --grad-ckpt",
         "vLLM worker + trainer, async"]


def test_the_gpu_check_rehearses_on_a_cpu_and_prints_one_table():
    pytest.importorskip("transformers", reason="the LLM path needs: pip install -r requirements-llm.txt")
    p = subprocess.run([sys.executable, "tests/gpu_check.py", "--cpu"], cwd=ROOT, capture_output=True, text=True,
                       check=False, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "# python tests/gpu_check.py --cpu\n# machine: CPU (--cpu); torch " in p.stdout
    table = [line.strip("| ").split(" | ") for line in p.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 4, p.stdout                # one header, one row per part: one table
    header, rows = table[0], {r[0]: dict(zip(table[0], r)) for r in table[1:]}
    assert list(rows) == PARTS and header[-1] == "note"
    measured = ["step_s", "steps/s", "peak GB", "steps", "wall s"]
    for part in PARTS[:3]:                              # every measured cell is a positive number
        for k in ["gen tok/s", "update tok/s", *measured]:
            assert float(rows[part][k]) > 0, (part, k, rows[part])
        assert float(rows[part]["logp_gap"]) >= 0
        assert rows[part]["steps"] == "2"               # --steps 3 on a CPU, the first one left out as warm-up
    assert "--grad-ckpt saves" in rows[PARTS[2]]["note"] and " GB of the peak (" in rows[PARTS[2]]["note"]
    commands = [line for line in p.stdout.splitlines() if line.startswith("#   python train.py")]
    assert commands[2] == commands[1] + " --grad-ckpt"  # the same run but for the flag: the drop is its alone
    async_row = rows[PARTS[3]]                          # the trainer + worker pair, an HF worker: no vLLM on a CPU
    assert all(float(async_row[k]) > 0 for k in measured) and async_row["gen tok/s"] == ""
    assert "no vllm (--cpu)" in async_row["note"] and "staleness" in async_row["note"]
    assert "max RSS of the train.py process (ru_maxrss)" in p.stdout


def test_without_a_gpu_it_says_so():
    p = subprocess.run([sys.executable, "tests/gpu_check.py"], cwd=ROOT, capture_output=True, text=True, check=False,
                       timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 1 and "no CUDA device" in p.stderr and "--cpu" in p.stderr
