"""Turns per solved held-out episode, greedy, for rung 2f (README): the base model and a run's final weights.

    python tests/turns_solved.py runs/smollm2_guess_turns.pt runs/smollm2_guess_blind.pt

Each checkpoint is evaluated on its own task (guess or guess_blind, from the checkpoint's config) over every
held-out game, and so is the base model first: prints eval_acc, turns per episode and per solved episode.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from train import Config, make_policy, make_task, read_checkpoint  # noqa: E402


def report(name, task, policy):
    out = task.evaluate(policy)
    turns = np.array([len(r["turns"]) // 2 if "turns" in r else 1 for r in out["samples"]])  # user, assistant
    solved = np.array([r["correct"] for r in out["samples"]])
    print(f"{name}: eval_acc {out['eval_acc']:.3f}, turns per episode {turns.mean():.2f}, per solved episode "
          f"{turns[solved].mean() if solved.any() else float('nan'):.2f}; solved by turn 1, 2, 3: "
          f"{[int((solved & (turns <= k)).sum()) for k in (1, 2, 3)]} of {len(solved)}", flush=True)


for path in sys.argv[1:]:
    ck = read_checkpoint(path)
    cfg = Config(**ck["config"])
    task = make_task(cfg)
    policy = make_policy(cfg, task)
    report(f"{cfg.task}, base", task, policy)
    policy.load_state_dict(ck["policy"], strict=False)
    report(f"{cfg.task}, {path} (step {ck['step']})", task, policy)
