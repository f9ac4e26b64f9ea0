"""tests/gpu_check.py has not run on a GPU yet; its --cpu rehearsal runs the very command its docstring gives for the
GPU machine (real train.py processes, the per-step CSV columns it reads, the trainer + HF worker pair, the rows
printed as measured, $OUT/gpu_check.md) on tiny shapes, so that the day a GPU is lent it works the first time."""
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ["smollm2 bf16 step", "0.5B-shaped bf16 step", "0.5B-shaped bf16 step, --grad-ckpt",
         "trainer + HF worker, async"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def gpu_command():
    """The command line gpu_check.py's docstring tells the GPU machine to run, as an argument list."""
    with open(os.path.join(ROOT, "tests", "gpu_check.py")) as f:
        doc = f.read().split('"""')[1]
    lines = [line.strip() for line in doc.splitlines() if line.strip().startswith("python3 tests/gpu_check.py")]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])[1:]


def check(args, out, timeout=300):
    """Run gpu_check.py ARGS with $OUT=out -> (process, {part: row}, the final table's text, wall seconds)."""
    pytest.importorskip("transformers", reason="the LLM path needs: pip install -r requirements-llm.txt")
    t0 = time.time()
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, check=False,
                       timeout=timeout, env={**ENV, "OUT": str(out)})
    final = p.stdout[p.stdout.rindex("| part | model |"):]           # the whole table, printed last
    table = [line.strip("| ").split(" | ") for line in final.splitlines() if line.startswith("| ")]
    rows = {r[0]: dict(zip(table[0], r)) for r in table[1:]}
    assert list(rows) == PARTS and table[0][-1] == "note", p.stdout
    live = [line for line in p.stdout[:p.stdout.rindex("| part | model |")].splitlines() if line.startswith("| ")]
    assert live[1:] == [line for line in final.splitlines() if line.startswith("| ")][1:]   # printed as measured
    assert (out / "gpu_check.md").read_text() == final                 # the same table, in $OUT
    return p, rows, final, time.time() - t0


@pytest.mark.slow
def test_the_gpu_machine_command_rehearses_on_a_cpu(tmp_path):
    args = gpu_command()
    assert args[0] == "tests/gpu_check.py"
    p, rows, final, wall = check([*args, "--cpu"], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.startswith(f"# python {shlex.join([*args, '--cpu'])}\n# machine: CPU (--cpu); torch ")
    measured = ["step_s", "steps/s", "peak GB", "steps", "wall s"]
    for part in PARTS[:3]:                              # every measured cell is a positive number
        for k in ["gen tok/s", "update tok/s", *measured]:
            assert float(rows[part][k]) > 0, (part, k, rows[part])
        assert float(rows[part]["logp_gap"]) >= 0
        assert rows[part]["steps"] == "2"               # --steps 3 on a CPU, the first one left out as warm-up
    assert "--grad-ckpt saves" in rows[PARTS[2]]["note"] and " GB of the peak (" in rows[PARTS[2]]["note"]
    commands = [line for line in p.stdout.splitlines() if line.startswith("# part ")]
    assert commands[2].split(" (limit")[0] == commands[1].split(" (limit")[0].replace("2/4", "3/4") + " --grad-ckpt"
    async_row = rows[PARTS[3]]                          # the trainer + an HF worker: no vLLM here (nor on the H200)
    assert all(float(async_row[k]) > 0 for k in measured) and async_row["gen tok/s"] == ""
    worker_peak = re.search(r"the worker's: ([^)]+)\)", async_row["note"])
    assert "staleness" in async_row["note"] and float(worker_peak[1]) > 0    # measured (RSS: 0.9 GB or 1 GB), not nan
    assert "max RSS of the train.py process (ru_maxrss)" in final
    kept = set(os.listdir(tmp_path / "gpu_check"))      # each part's log and CSV, for the day a row looks wrong
    assert {"smollm2.log", "smollm2.csv", "ckpt.csv", "async.csv", "async.worker.log"} <= kept
    assert wall < 240 + 15                               # --cpu's deadline, + the interpreter's start and exit


@pytest.mark.slow
def test_a_failed_part_gets_its_row_and_the_deadline_holds(tmp_path):
    """Part 1's train.py refuses a flag: its row says why, part 2 still runs, and the check still ends by its
    60 s deadline (whatever is left of part 4 is stopped or not run) with the whole table, in $OUT too. 60 s,
    not 30: on 2 cores shared with other work, part 2 then had 5 s left and logged no step."""
    p, rows, final, wall = check(["tests/gpu_check.py", "--cpu", "--break-part", "1", "--budget-s", "60"], tmp_path)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    note = rows[PARTS[0]]["note"]
    assert re.match(r"FAILED after \d+ s: train.py exited [12]: .*--no-such-flag", note), note   # its log's last line
    assert rows[PARTS[0]]["steps"] == ""
    assert rows[PARTS[1]]["steps"] == "2"               # the next part ran, measured
    assert wall < 60 + 15, wall                          # + the interpreter's start and exit, on 2 busy cores
    for part in PARTS[2:]:                               # measured, stopped at the deadline, or not run
        assert rows[part]["steps"] or "FAILED" in rows[part]["note"] or "not run" in rows[part]["note"], rows[part]


@pytest.mark.slow
def test_without_a_gpu_it_says_so():
    p = subprocess.run([sys.executable, "tests/gpu_check.py"], cwd=ROOT, capture_output=True, text=True, check=False,
                       timeout=120, env=ENV)
    assert p.returncode == 1 and "no CUDA device" in p.stderr and "--cpu" in p.stderr
