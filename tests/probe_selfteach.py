"""Which task suits --teacher self? Two measured questions, on the model as it starts, per task:

  1. is GRPO's signal sparse: the share of groups whose samples all got the same reward (zero_std_frac:
     those teach GRPO nothing), and the mean reward;
  2. does the model, shown the task's privileged prompt (tasks.LLMTask.privileged), rank the right tokens
     higher: the reference answer's ids as a completion (the answer alone, then the end of the turn), their
     log-prob under the privileged prompt minus under the student's (nats per answer, and how often > 0);
     and on the sampled rows, each one's mean per-token grade, log pi_teacher - log pi_student (what --algo
     opd trains on), for right rows against wrong ones, and how often a right row outranks a wrong one of
     the same prompt (AUC over those pairs; 0.5: the grade knows nothing of the answer).

    python tests/probe_selfteach.py --model runs/smollm2 --tasks addition,addition_control,multiply,countdown

Same prompts, seed and samples for every task of one kind (addition and its control share them).
"""
import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import HFPolicy  # noqa: E402
from core import Batch, Trajectory  # noqa: E402
from tasks import TASKS, Addition  # noqa: E402
from train import self_taught  # noqa: E402


def as_batch(prompts, completions, G):
    """Prompt ids and completion ids -> a Batch as task.rollout stacks it (reward 0)."""
    rows = []
    for p, c in zip(prompts, completions):
        ids = torch.tensor(p + c)
        mask = torch.cat([torch.zeros(len(p)), torch.ones(len(c))])
        rows.append(Trajectory(states=ids, actions=ids, logp=torch.zeros(len(ids)), rewards=torch.zeros(len(ids)),
                               mask=mask))
    return Batch.from_rows(rows, G)


class LongAddition(Addition):
    """A probe-only candidate: 'What is 347 + 485?', three digits each."""

    def problem(self, rng):
        a, b = rng.integers(100, 1000, size=2).tolist()
        return {"prompt": f"What is {a} + {b}? Answer with the number only.", "answer": str(a + b)}


def probe(policy, task, n_prompts, G, seed):
    problems = task.sample(n_prompts, np.random.default_rng(seed))
    torch.manual_seed(seed)
    batch = task.rollout(policy, problems, G)
    R = batch.grouped_rewards()                                                   # [n, G]
    right = R >= 1                                                                # rewards[0] == 1
    teacher = self_taught(policy, task, batch, problems, micro_batch=16)          # [N, T]
    student = policy.logprobs(batch)[0]
    grade = ((teacher - student) * batch.mask).sum(1) / batch.mask.sum(1)         # [N] mean per token
    grade = grade.view(n_prompts, G)
    pairs = [(a > b) + 0.5 * (a == b) for i in range(n_prompts)
             for a in grade[i][right[i]] for b in grade[i][~right[i]]]
    texts = [f"<answer>{p['solution']}</answer>" if "solution" in p else p["answer"] for p in problems]
    answers = [policy.tok.encode(t, add_special_tokens=False) + policy.eos[:1] for t in texts]
    ids = task.prompt_ids(policy.encode, problems)
    forced = as_batch(ids, answers, 1)
    lift = ((self_taught(policy, task, forced, problems, 16) - policy.logprobs(forced)[0]) * forced.mask).sum(1)
    return {"lift": lift.mean().item(), "lift_pos": (lift > 0).float().mean().item(),
            "zero_std_frac": batch.equal_groups().float().mean().item(), "reward": R.mean().item(),
            "right_rows": int(right.sum()), "grade_right": grade[right].mean().item() if right.any() else None,
            "grade_wrong": grade[~right].mean().item(), "auc": float(np.mean(pairs)) if pairs else None,
            "pairs": len(pairs)}


def main():
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--model", default="runs/smollm2")
    cli.add_argument("--tasks", default="addition,addition_control,multiply,countdown")
    cli.add_argument("--n-prompts", type=int, default=16)
    cli.add_argument("--group-size", type=int, default=8)
    cli.add_argument("--max-new-tokens", type=int, default=32)
    cli.add_argument("--seed", type=int, default=0)
    args = cli.parse_args()
    torch.set_num_threads(os.cpu_count())
    policy = HFPolicy(args.model, lora_r=16, max_new_tokens=args.max_new_tokens)   # the adapter off: the teacher
    print(f"# python {' '.join(sys.argv)}")
    print("| task | answer's log-prob, shown it - not (nats) | higher when shown | groups all equal "
          "(zero_std_frac) | mean reward | right rows | mean grade, right rows | mean grade, wrong rows | "
          "right above wrong (AUC, pairs) | s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.tasks.split(","):
        t0 = time.time()
        task = (TASKS | {"long_addition": LongAddition})[name](max_new_tokens=args.max_new_tokens)
        r = probe(policy, task, args.n_prompts, args.group_size, args.seed)
        f = lambda x: "-" if x is None else f"{x:.3f}"   # noqa: E731
        print(f"| {name} | {r['lift']:+.2f} | {r['lift_pos']:.0%} | {r['zero_std_frac']:.2f} | {r['reward']:.3f} | {r['right_rows']} | "
              f"{f(r['grade_right'])} | {f(r['grade_wrong'])} | {f(r['auc'])} ({r['pairs']}) | "
              f"{time.time() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
