"""Async transport and throughput figures (prints a table; asserts nothing about speed).

    python tests/bench_async.py

1. publish + pull of a LoRA r=16 adapter shaped like Qwen2-0.5B's (all linear layers, fp32) over
   loopback: MB/s for the trainer's serialization + one worker's download.
2. steps/s of sync vs async (trainer + 2 rollout workers, k=2) on CartPole and on the tiny LLM, and
   the trainer's idle fraction (time waiting for batches / step time), from the CSVs.
"""
import csv
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from serve import TrainerClient, TrainerServer, tensors_from_bytes  # noqa: E402

TOKEN = "bench-token"
ENV = {**os.environ, "NANORL_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}


def qwen05b_lora(r=16):
    """The adapter tensors of LoRA r on every linear layer of Qwen2-0.5B (24 layers, 896 wide, GQA 2 KV heads)."""
    shapes = {"q_proj": (896, 896), "k_proj": (896, 128), "v_proj": (896, 128), "o_proj": (896, 896),
              "gate_proj": (896, 4864), "up_proj": (896, 4864), "down_proj": (4864, 896)}
    return {f"layers.{i}.{n}.lora_{ab}.weight": torch.randn((r, fin) if ab == "A" else (fout, r))
            for i in range(24) for n, (fin, fout) in shapes.items() for ab in "AB"}


def bench_transport():
    tensors = qwen05b_lora()
    mb = sum(t.numel() * 4 for t in tensors.values()) / 1e6
    server = TrainerServer(TOKEN, {}, 2, port=0, host="127.0.0.1").start()
    client = TrainerClient(f"http://127.0.0.1:{server.port}", TOKEN)
    times = []                                          # [publish (serialize), HTTP transfer, parse] per version
    for v in range(1, 8):
        t0 = time.perf_counter()
        server.publish(v, tensors)
        t1 = time.perf_counter()
        raw = client._call("GET", f"/weights?version={v}")
        t2 = time.perf_counter()
        got = tensors_from_bytes(raw)[0]
        times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    server.stop()
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    pub, net, parse = (sorted(x)[len(x) // 2] for x in zip(*times))
    print(f"LoRA r=16 adapter of a Qwen2-0.5B-shaped model: {len(tensors)} tensors, {mb:.1f} MB (medians of 7):")
    print(f"  publish (serialize once) {pub * 1e3:.0f} ms; transfer {net * 1e3:.0f} ms = {mb / net:.0f} MB/s; "
          f"parse {parse * 1e3:.0f} ms; publish + pull end to end {mb / (pub + net + parse):.0f} MB/s")


def run(args, out, workers=0):
    port = 18000 + os.getpid() % 1000
    role = ["--role", "trainer", "--serve-port", str(port)] if workers else []
    t0 = time.time()
    trainer = subprocess.Popen([sys.executable, "train.py", *args, *role, "--out", out], cwd=ROOT, env=ENV,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ws = [subprocess.Popen([sys.executable, "train.py", *args, "--role", "rollout", "--trainer-url",
                            f"http://127.0.0.1:{port}"], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL) for _ in range(workers)]
    trainer.wait()
    wall = time.time() - t0
    for w in ws:
        w.kill()
    rows = [r for r in csv.DictReader(open(out + ".csv")) if r["step"] != "0"]
    step_s, wait_s = sum(float(r["step_s"]) for r in rows), sum(float(r["gen_s"]) for r in rows)
    return len(rows) / step_s, wait_s / step_s, wall, rows[-1]


def main():
    bench_transport()
    with tempfile.TemporaryDirectory() as tmp:
        from model import make_tiny_lm
        tiny = make_tiny_lm(os.path.join(tmp, "tiny"))
        jobs = {"CartPole, REINFORCE, 32 episodes/step": ["--steps", "40", "--solve-at", "0", "--eval-every", "0"],
                "tiny LLM, GRPO, 16 prompts x 8": ["--config", "configs/tiny_maxdigit.yaml", "--model", tiny,
                                                  "--steps", "40", "--eval-every", "0"]}
        print(f"{'job':40} {'mode':18} {'steps/s':>8} {'idle':>6} {'wall s':>7} {'dropped':>8}")
        for name, args in jobs.items():
            for mode, workers in (("sync", 0), ("async, 2 workers", 2)):
                sps, idle, wall, last = run(args, os.path.join(tmp, f"{workers}{len(name)}"), workers)
                dropped = "" if not workers else str(int(last["dropped_stale"]) + int(last["dropped_no_snapshot"]))
                print(f"{name:40} {mode:18} {sps:8.1f} {idle if workers else 0:6.0%} {wall:7.1f} {dropped:>8}", flush=True)
    print("idle: the trainer's gen_s (waiting for a worker batch + recomputing its old log-probs) / step_s.")


if __name__ == "__main__":
    main()
