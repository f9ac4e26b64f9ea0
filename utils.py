"""Masked math on raw tensors, returns and GAE, Adam, torch.distributed plumbing and the logger.

Invariant: every reduction over padded [N, T] tensors goes through masked_sum / whiten,
and every statistic that must match one process (whiten's mean and std) is summed over all ranks."""
import csv
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


# ---- masked reductions (padding stays exactly 0) ----

def masked_sum(x, mask):
    return (x * mask).sum()


def whiten(x, mask):
    """(x - mean) / std over the masked entries of every rank; padding stays 0."""
    n = all_sum(mask.sum()).clamp(min=1)
    mean = all_sum(masked_sum(x, mask)) / n
    var = all_sum(masked_sum((x - mean) ** 2, mask)) / n
    return (x - mean) / (var.sqrt() + 1e-8) * mask


# ---- returns and GAE: truncation bootstraps from V(final state), termination does not ----

def gae(rewards, values, mask, gamma, lam, bootstrap=None):
    """A_t = delta_t + gamma*lam*A_{t+1}, delta_t = r_t + gamma*V_{t+1} - V_t (Schulman 2016). After a row's
    last step V_{t+1} = bootstrap [N] (None: 0), A_{t+1} = 0. rewards, values, mask [N, T] -> [N, T]."""
    boot = 0.0 if bootstrap is None else bootstrap[:, None]
    has_next = F.pad(mask[:, 1:], (0, 1))                                   # [N, T]: step t+1 is real
    v_next = torch.where(has_next > 0, F.pad(values[:, 1:], (0, 1)), boot)  # [N, T]
    delta = rewards + gamma * v_next - values                                # [N, T]
    adv, last = torch.zeros_like(rewards), 0.0
    for t in reversed(range(rewards.shape[1])):
        last = (delta[:, t] + gamma * lam * last) * mask[:, t]              # so A_{t+1} is 0 past a row's end
        adv[:, t] = last
    return adv                                                               # [N, T]


def discounted_returns(rewards, mask, gamma, bootstrap=None):
    """G_t = r_t + gamma * G_{t+1}; after a row's last step G_{t+1} = bootstrap [N] (None: 0) -> [N, T]."""
    return gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0, bootstrap)


class Adam:
    """Adam (Kingma & Ba 2015) for control tasks: torch.optim.Adam's constructor imports torch._dynamo,
    1.3 s on these 2 cores, a third of a CartPole run (measured). LLMs use torch's fused Adam (train.py)."""

    def __init__(self, groups, lr):
        self.params = [p for g in groups for p in g]                        # one lr for every group
        self.lr, self.t = lr, 0
        self.m = [torch.zeros_like(p) for p in self.params]                 # fp32, like the params
        self.v = [torch.zeros_like(p) for p in self.params]

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        """p -= lr * m_hat / (sqrt(v_hat) + eps), with m_hat, v_hat the bias-corrected moments."""
        b1, b2 = 0.9, 0.999                                                  # torch's defaults, eps 1e-8 too
        self.t += 1
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is not None:
                m.lerp_(p.grad, 1 - b1)                                      # m = b1 m + (1-b1) g
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)            # v = b2 v + (1-b2) g^2
                denom = (v / (1 - b2 ** self.t)).sqrt_().add_(1e-8)
                p.addcdiv_(m, denom, value=-self.lr / (1 - b1 ** self.t))

    def state_dict(self):
        return {"t": self.t, "m": self.m, "v": self.v}

    def load_state_dict(self, state):
        self.t = state["t"]
        for mine, saved in zip(self.m + self.v, state["m"] + state["v"], strict=True):
            mine.copy_(saved)


# ---- torch.distributed: torchrun sets RANK / WORLD_SIZE; gloo on CPU, nccl on GPU ----

def device_for(is_llm, cuda_count, local_world):
    """Where a rank's policy lives (2 ranks on 1 GPU failed in set_device: "invalid device ordinal")."""
    return "cuda" if is_llm and local_world <= cuda_count else "cpu"


def local_device(is_llm):                       # its GPU is LOCAL_RANK's (0 without torchrun)
    kind = device_for(is_llm, torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return torch.device(kind, int(os.environ.get("LOCAL_RANK", 0)) if kind == "cuda" else None)


def init_distributed(timeout=1800.0, backend="", llm=False):
    """-> (rank, world_size); (0, 1) without torchrun. One group: gloo for CPU tensors (statistics, objects),
    and NCCL for CUDA ones if llm (an NCCL-only group cannot reduce a CPU tensor). timeout (s) must outlast
    one rank's longest wait on another (rank 0's --batch-timeout), or NCCL's watchdog kills the waiters."""
    if os.environ.get("WORLD_SIZE", "1") == "1":
        return 0, 1
    if not dist.is_initialized():
        device = local_device(llm)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif os.environ.get("RANK", "0") == "0":
            why = f"{torch.cuda.device_count()} GPUs, fewer than the ranks here" if llm else "an MLP policy"
            print(f"torch.distributed: gloo, the policy on the CPU ({why})", flush=True)
        # the NCCL half needs a GPU even to initialize ("ProcessGroupNCCL is only supported with GPUs")
        dist.init_process_group(backend or ("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"),
                                timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def is_distributed():
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_sum(x):
    """Sum of a tensor (or float) over ranks; identity in one process."""
    if not is_distributed():
        return x
    t = x.clone() if torch.is_tensor(x) else torch.tensor(x, dtype=torch.float64, device="cpu")   # for gloo
    dist.all_reduce(t)
    return t if torch.is_tensor(x) else t.item()


def all_reduce_grads(params):
    """SUM gradients over ranks: each rank's loss already divides by the global denominator."""
    if is_distributed():
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        for g, new in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(new.view_as(g))


def broadcast_params(params):
    """Rank 0's trainable weights everywhere, so every rank starts from the same model."""
    if is_distributed():
        for p in params:
            dist.broadcast(p.data, 0)


# ---- logging, rank 0 only: a CSV row per step, a line on stdout, samples ----

class Logger:
    def __init__(self, enabled=True):
        self.enabled, self.file, self.t0 = enabled, None, time.time()

    def open_csv(self, path, columns, keep_until):
        """Keep the rows of steps <= keep_until (a resumed run's step; a new run has no CSV yet), drop the
        later ones (they are trained again): one row per step however often the run was interrupted."""
        if not self.enabled:
            return
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        kept = []
        if os.path.exists(path):
            with open(path, newline="") as f:
                kept = [r for r in csv.DictReader(f)
                        if r.get("step", "").isdigit() and int(r["step"]) <= keep_until]
        with open(f"{path}.tmp", "w", newline="") as f:    # rewritten whole, then renamed: never half a CSV
            w = csv.DictWriter(f, columns, extrasaction="ignore")
            w.writeheader()
            w.writerows(kept)
        os.replace(f"{path}.tmp", path)
        self.file = open(path, "a", newline="")
        self.csv = csv.DictWriter(self.file, columns)
        # appended to (made by the first sample: LLM tasks): after a --resume, steps trained again log again
        self.samples_path = path.removesuffix(".csv") + ".samples.jsonl"

    def log(self, row, group=()):
        """A CSV row. An evaluation's row["samples"] (greedy LLM completions): the first 8 (the same problems
        each time), then the training group's with rewards and advantages, a line each in <out>.samples.jsonl
        (head or jq reads it); the first right and wrong ones under the step line. Your tracker goes here
        (rank 0's alone, as the CSV): wandb.log(row, step=row["step"]), after wandb.init(...) in train()."""
        held_out = row.pop("samples", [])
        if self.file:
            self.csv.writerow(row)          # a missing column is written blank, an unknown one raises
            self.file.flush()
            if held_out:
                with open(self.samples_path, "a") as f:
                    for record in [*held_out[:8], *group]:
                        f.write(json.dumps({"step": row["step"], **record}) + "\n")
        for right in (True, False):
            if shown := next((r for r in held_out if r["correct"] == right), None):  # !r: a line, \n escaped
                self.info(f"  {'right' if right else 'wrong'}: {shown['prompt']!r} -> {shown['completion']!r}"
                          [:150])

    def progress(self, row, keys, steps, sec_per_step):
        """step i/N, the metrics in keys, s/step, elapsed, ETA (an upper bound: runs may stop once solved)."""
        hms = lambda s: time.strftime("%H:%M:%S" if s >= 3600 else "%M:%S", time.gmtime(s))
        metrics = "  ".join(f"{k} {row[k]:.4g}" for k in keys if row.get(k, "") != "")   # ints, floats, nan
        self.info(f"step {row['step']:>{len(str(steps))}}/{steps}  {metrics}  {row['step_s']:.2f} s/step  "
                  f"{hms(time.time() - self.t0)} elapsed, eta {hms(sec_per_step * (steps - row['step']))}")

    def info(self, msg):
        if self.enabled:
            print(msg, flush=True)
