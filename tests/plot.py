"""Plot a run's CSV (or several, overlaid) to a PNG: the panels that fit the run's kind.

    python tests/plot.py runs/cartpole_reinforce.csv                 # -> runs/cartpole_reinforce.png
    python tests/plot.py results/cartpole_*.csv --x env_steps -o assets/cartpole.png

Panels, each only when the CSV has values in the columns (not all 0): the held-out metric (eval_return or eval_acc, pass@k)
with the training reward; ratio and clip fraction; the sampler/trainer log-prob gap (logp_gap,
gap_out_frac); async staleness and drops; seconds per step (generation vs update). Several CSVs:
the first panel only, one line per run and column.
matplotlib is an optional extra: pip install matplotlib.
"""
import argparse
import csv
import os
import sys

PANELS = [  # (title, [(column, style)])
    ("held-out metric and training reward", [("eval_return", "o-"), ("eval_acc", "o-"), ("pass_at_k", "s--"),
                                             ("reward", "-"), ("tool_frac", ":")]),
    ("ratio and clip fraction", [("ratio", "-"), ("clip_frac", "-")]),
    ("sampler vs trainer log-probs", [("logp_gap", "-"), ("gap_out_frac", "-")]),
    ("async: staleness and drops", [("staleness", "-"), ("dropped_stale", "-"), ("dropped_no_snapshot", "-")]),
    ("seconds per step", [("gen_s", "-"), ("train_s", "-")]),
]


def read(path):
    """The CSV's rows, each with "minutes" added: training time so far, the sum of step_s (evaluations and the
    model's load left out)."""
    with open(path, newline="") as f:
        rows, t = list(csv.DictReader(f)), 0.0
    for r in rows:
        t += float(r.get("step_s") or 0)
        r["minutes"] = str(t / 60)
    return rows


def series(rows, x, y):
    """(xs, ys) over the rows where y has a value; eval columns are empty on steps without evaluation."""
    pts = [(float(r[x]), float(r[y])) for r in rows if r.get(y) not in (None, "") and r.get(x) not in (None, "")]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot(paths, out, x="step"):
    try:
        import matplotlib
    except ImportError:
        sys.exit("error: plotting needs matplotlib, an optional extra: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = {os.path.splitext(os.path.basename(p))[0]: read(p) for p in paths}
    informative = lambda c: any(any(series(rows, x, c)[1]) for rows in runs.values())   # some value != 0
    panels = [(title, [(c, st) for c, st in cols if informative(c)])
              for title, cols in (PANELS if len(runs) == 1 else PANELS[:1])]  # several runs: compare the metric
    panels = [(t, cols) for t, cols in panels if cols]
    if not panels:
        sys.exit(f"error: {', '.join(paths)}: no rows with metrics to plot (is it a NanoRL CSV?)")
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, cols) in zip(axes[:, 0], panels):
        for name, rows in runs.items():
            for c, style in cols:
                xs, ys = series(rows, x, c)
                if xs:
                    ax.plot(xs, ys, style, ms=3, label=c if len(runs) == 1 else f"{name}: {c}")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel(x)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", nargs="+", help="run CSVs (<out>.csv), overlaid when several")
    p.add_argument("-o", "--out", default="", help="PNG to write (default: the first CSV with .png)")
    p.add_argument("--x", default="step", help="x axis column: step, env_steps or minutes")
    a = p.parse_args()
    missing = [c for c in a.csv if not os.path.isfile(c)]
    if missing:
        sys.exit(f"error: no such CSV: {', '.join(missing)} (a run writes <out>.csv; its first lines say where)")
    plot(a.csv, a.out or os.path.splitext(a.csv[0])[0] + ".png", a.x)
