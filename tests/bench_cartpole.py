"""CartPole speed: wall time from process start to the first greedy held-out return of 500.

    python tests/bench_cartpole.py [--seeds 3] [--algos reinforce,ppo] [--threads 1,2]

Runs every configs/cartpole_*.yaml as a fresh process per seed, one at a time (the machine is
small: parallel runs would time each other). Prints a table; asserts nothing about speed.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOLVED = re.compile(r"solved: .* at step (\d+), ([\d.]+) s after process start, (\d+) env steps")


def run(config, seed, out, threads):
    t0 = time.time()
    p = subprocess.run([sys.executable, "train.py", "--config", config, "--seed", str(seed), "--out", out,
                        "--threads", str(threads)], cwd=ROOT, capture_output=True, text=True)
    wall = time.time() - t0
    m = SOLVED.search(p.stdout)
    return (float(m[2]), wall, int(m[1]), int(m[3])) if m else (None, wall, None, None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--algos", default="reinforce,reinforce_baseline,ppo,grpo,rloo")
    ap.add_argument("--threads", default="1", help="torch threads to compare, e.g. 1,2 (train.py's default: 1)")
    args = ap.parse_args()
    print(f"CPU: {cpu()}")
    print("time to solve: process start -> first greedy held-out return of 500 (train.py's own clock);")
    print("wall: the whole process, interpreter start to exit. Medians [min-max] over seeds 0..n-1.")
    print(f"{'config':41} {'solved':>6} {'to solve s':>16} {'per seed':>15} {'wall s':>16} {'steps':>6} {'env steps':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for algo, threads in [(a, int(n)) for a in args.algos.split(",") for n in args.threads.split(",")]:
            cfg = f"configs/cartpole_{algo}.yaml" + (f" --threads {threads}" if "," in args.threads else "")
            runs = [run(cfg.split()[0], s, os.path.join(tmp, f"{algo}{s}-{threads}"), threads) for s in range(args.seeds)]
            ok = [r for r in runs if r[0] is not None]
            med = lambda i: statistics.median(r[i] for r in ok) if ok else float("nan")
            spread = lambda i: f"{med(i):.1f} [{min(r[i] for r in ok):.1f}-{max(r[i] for r in ok):.1f}]" if ok else "-"
            seeds = " ".join(f"{r[0]:.1f}" if r[0] else "fail" for r in runs)
            print(f"{cfg:41} {len(ok)}/{len(runs):<4} {spread(0):>16} {seeds:>15} {spread(1):>16} {med(2):6.0f} "
                  f"{med(3):9.0f}", flush=True)


def cpu() -> str:
    """The CPU the figures come from: model, cores this process may use, vector extensions (Linux)."""
    info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    model = re.search(r"model name\s*: (.*)", info)
    flags = set((re.search(r"flags\s*: (.*)", info) or [None, ""])[1].split())
    ext = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if x in flags]
    return f"{model[1] if model else 'unknown'}, {len(os.sched_getaffinity(0))} cores, {'/'.join(ext) or 'no AVX2'}"


if __name__ == "__main__":
    main()
