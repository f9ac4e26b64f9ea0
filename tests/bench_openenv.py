"""The server path's overhead per turn: the same games' environment steps, in-process (--task guess) and
through an OpenEnv server (--task openenv against tests/openenv_guess.py, started here on loopback).

    python tests/bench_openenv.py [--episodes 64] [--turns 3] [--repeats 10]   # ~15 s on 2 idle cores

A repeat: --episodes environments reset (each on a session of its own), then --turns turns each stepped the
way the sampler steps them, every episode's at once (tasks.take_turns: one decoding step that ends them all,
the slowest case), then closed. Every guess is wrong, so every episode plays every turn. Prints wall ms,
median [min-max] over the repeats: per turn, and for the episodes' reset and close. Asserts nothing."""
import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tasks import Guess, OpenEnv, concurrently, take_turns  # noqa: E402

from test_openenv import served  # noqa: E402


def repeat(task, problems, turns):
    """One repeat -> (reset s, [s per turn], close s)."""
    episodes = [SimpleNamespace(env=task.environment(p), problem=p, max_turns=turns + 1, turns=1, reward=None,
                                failed=None) for p in problems]                   # as tasks.play makes them
    t0 = time.perf_counter()
    concurrently([(e.env.reset, p) for e, p in zip(episodes, problems)])
    times = [time.perf_counter() - t0]
    for _ in range(turns):
        t0 = time.perf_counter()
        messages = take_turns(episodes, ["0"] * len(episodes))            # 0: never in range, always wrong
        times.append(time.perf_counter() - t0)
        assert all(m and m.startswith("Wrong") for m in messages) and not any(e.failed for e in episodes)
    t0 = time.perf_counter()
    concurrently([(e.env.close,) for e in episodes if hasattr(e.env, "close")])
    return times[0], times[1:], time.perf_counter() - t0


def ms(seconds):
    return f"{1e3 * statistics.median(seconds):8.2f} [{1e3 * min(seconds):.2f}-{1e3 * max(seconds):.2f}]"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    print(f"{args.episodes} episodes x {args.turns} turns, every episode's turn at once; wall ms, median "
          f"[min-max] over {args.repeats} repeats (turn: repeats x turns); load {os.getloadavg()[0]:.2f}")
    with served("openenv_guess.py") as url:
        for name, task in [("in-process", Guess()), ("OpenEnv server", OpenEnv(data=url))]:
            problems = task.sample(args.episodes, np.random.default_rng(0))
            repeat(task, problems, args.turns)                                # warm-up: connections, imports
            runs = [repeat(task, problems, args.turns) for _ in range(args.repeats)]
            print(f"{name:15} turn {ms([t for _, ts, _ in runs for t in ts])}   reset "
                  f"{ms([r[0] for r in runs])}   close {ms([r[2] for r in runs])}")


if __name__ == "__main__":
    main()
