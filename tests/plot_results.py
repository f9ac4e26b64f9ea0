"""Plots results/*.csv into assets/*.png for the README (needs matplotlib, not a dependency).

    python tests/plot_results.py
"""
import csv
import glob
import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def series(path, x, y):
    rows = [r for r in csv.DictReader(open(path)) if r.get(y)]
    return [float(r[x]) for r in rows], [float(r[y]) for r in rows]


def main():
    os.makedirs(os.path.join(ROOT, "assets"), exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for path in sorted(glob.glob(os.path.join(ROOT, "results", "cartpole_*.csv"))):
        ax.plot(*series(path, "env_steps", "eval_return"), marker=".", label=os.path.basename(path)[9:-4])
    ax.set(xlabel="environment steps", ylabel="greedy held-out return", title="CartPole-v1, seed 0")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, "assets", "cartpole.png"), dpi=100)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(*series(os.path.join(ROOT, "results", "tiny_maxdigit.csv"), "step", "eval_acc"), marker=".")
    ax.axhline(1 - 0.9**3, ls="--", c="gray", label="always '9' (27.1%)")
    ax.set(xlabel="GRPO step (16 prompts x 8 samples)", ylabel="held-out greedy accuracy", ylim=(0, 1),
           title="Tiny char-level LM learns 'largest digit' by RL (CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(ROOT, "assets", "tiny_maxdigit.png"), dpi=100)


if __name__ == "__main__":
    main()
