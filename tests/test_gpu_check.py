"""tests/gpu_check.py has not run on a GPU yet; its --cpu rehearsal runs the same code path (real train.py
processes, the CSV columns it reads, the table it prints) on tiny shapes, so the day a GPU is lent it works."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_gpu_check_rehearses_on_a_cpu_and_prints_one_table():
    pytest.importorskip("transformers", reason="the LLM path needs: pip install -r requirements-llm.txt")
    p = subprocess.run([sys.executable, "tests/gpu_check.py", "--cpu"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    table = [line for line in p.stdout.splitlines() if line.startswith("| ")]
    header, rows = table[0].split(" | "), [r.strip("| ").split(" | ") for r in table[1:]]
    assert [r[0] for r in rows] == ["tiny (CPU rehearsal), bf16 step", "tiny (CPU rehearsal), bf16 step",
                                    "tiny (CPU rehearsal), bf16 step, --grad-ckpt", "trainer + vLLM worker, one GPU"]
    for r in rows[:3]:                                   # every measured cell is a positive number
        cells = dict(zip(header[1:], r[1:]))
        for k in ("gen tok/s", "update tok/s", "step_s", "steps/s", "peak GB"):
            assert float(cells[k]) > 0, (k, r)
    assert "--grad-ckpt saves" in rows[2][-1] and "skipped with --cpu" in rows[3][-1]
    assert "machine: CPU (--cpu)" in p.stdout


def test_without_a_gpu_it_says_so():
    p = subprocess.run([sys.executable, "tests/gpu_check.py"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 1 and "no CUDA device" in p.stderr and "--cpu" in p.stderr
