"""How much of a step's arithmetic teaches: positions the model computes that were needed, over positions it
computes, in decoding and in the update, counted on a preset's real steps (train() itself, in-process).

    python tests/bench_useful.py --config configs/smollm2_addition.yaml --steps 5 [--out runs/useful_2b]

Decode: every one-token forward of generation is a row computed; a completion of n ids (inserted ones
included) needs n - 1 of them after the prefill (its last id is never fed back). Update (forwards with
gradient): every input position computed (prefixes, left and right padding included); needed are, for each
row whose advantage is not 0 everywhere (GRPO: a group whose rewards differ), its completion's positions and
its prompt's prefix once per micro-batch it appears in. Needs a GRPO or RLOO preset without a teacher, KL or
entropy bonus (whose rows all count as needed: not handled here). The prefill is left out of both. Runs on
any checkout of this project (copy it into an older one to measure the code before). Prints a line per step
and the totals; asserts nothing.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="")
    a = p.parse_args()
    sys.path.insert(0, ROOT)
    os.chdir(ROOT)
    import torch
    import train
    from core import Batch
    cfg = train.parse_config(["--config", a.config, "--steps", str(a.steps), "--eval-every", "0",
                              "--solve-at", "0", *(["--out", a.out] if a.out else [])])
    assert cfg.algo in ("grpo", "rloo") and not (cfg.teacher or cfg.kl_coef or cfg.ent_coef), cfg.algo
    count = {"decode": 0, "update": 0}          # positions computed, this step
    need = {"decode": 0, "update": 0}           # positions needed, this step
    totals = {k: [0, 0] for k in count}

    def forward_pre(module, args, kwargs):
        ids = kwargs["input_ids"]               # [rows, positions]
        if torch.is_grad_enabled():
            count["update"] += ids.numel()
        elif ids.shape[1] == 1:                 # a decoding step (the prefill has the prompts' lengths)
            count["decode"] += ids.shape[0]

    make_policy = train.make_policy

    def hooked_policy(*args, **kw):
        policy = make_policy(*args, **kw)
        policy.model.register_forward_pre_hook(forward_pre, with_kwargs=True)
        return policy
    train.make_policy = hooked_policy

    def rows_needed(batch, micro_batch):
        """The update's needed positions: rows of a group whose rewards differ, their completions, and
        their prompts' prefixes once per micro-batch (rows in update()'s order, micro_batch at a time)."""
        P = batch.mask.argmax(1)                                                  # [N] prompt lengths
        C = batch.mask.shape[1] - batch.mask.flip(1).argmax(1) - P               # [N] completion lengths
        signal = (~batch.equal_groups()).repeat_interleave(batch.group_size)     # [N]
        rows = signal.nonzero()[:, 0].tolist()
        size = micro_batch or max(len(rows), 1)
        total = 0
        for i in range(0, len(rows), size):
            chunk = rows[i:i + size]
            prefixes = {tuple(batch.states[r, :P[r] - 1].tolist()) for r in chunk}
            total += sum(map(len, prefixes)) + int(C[chunk].sum())
        return total

    from_rows = Batch.from_rows

    def counted_batch(rows, group_size):        # the rollout's batch: what decoding needed, and the update
        batch = from_rows(rows, group_size)
        if batch.states.dim() == 2:
            C = batch.mask.shape[1] - batch.mask.flip(1).argmax(1) - batch.mask.argmax(1)   # [N]
            need["decode"] += int((C - 1).clamp(min=0).sum())
            need["update"] += rows_needed(batch, cfg.micro_batch) * cfg.inner_epochs
        return batch
    Batch.from_rows = staticmethod(counted_batch)

    log = train.Logger.log

    def log_row(self, row, group=()):
        if row.get("step"):
            useful = {k: need[k] / count[k] if count[k] else 1.0 for k in count}
            print(f"step {row['step']}: decode {need['decode']}/{count['decode']} = {useful['decode']:.3f}, "
                  f"update {need['update']}/{count['update']} = {useful['update']:.3f}, step_s "
                  f"{row['step_s']:.2f}", flush=True)
            for k in count:
                totals[k][0] += need[k]
                totals[k][1] += count[k]
        for k in count:
            count[k] = need[k] = 0
        return log(self, row, group)
    train.Logger.log = log_row
    train.train(cfg)
    print("useful over the steps: " + ", ".join(f"{k} {n}/{c} = {n / c if c else 1.0:.3f}"
                                                for k, (n, c) in totals.items()))


if __name__ == "__main__":
    main()
