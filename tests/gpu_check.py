"""GPU check, ready for the day a GPU machine is lent: one table, about 5-8 minutes on one H200. NOT RUN YET.

    python tests/gpu_check.py [--smollm2 runs/smollm2]   # a CUDA machine (vLLM optional: pip install vllm==0.33.0)
    python tests/gpu_check.py --cpu                      # the same code path on a CPU, tiny shapes (tests/test_gpu_check.py)

Rows, each a real `python train.py` process on the GPU (GRPO, Countdown prompts, LoRA r=16, bf16, 16 prompts
x 8 samples x 256 new tokens, eval off), medians over the steps after the first:
  - SmolLM2-135M-Instruct (--smollm2 DIR; without it, a random-weight model of its shape), and a Qwen2-0.5B-shaped
    random-weight model (hidden 896, 24 layers, 14 heads, 2 KV heads, vocab 151936): generation and update tokens/s,
    step_s, and the peak GPU memory torch allocated in that process (torch.cuda.max_memory_allocated);
  - the 0.5B-shaped step again with --grad-ckpt: the activation memory it saves is the drop in that peak;
  - a trainer and one --vllm worker sharing the GPU (vLLM capped at --vllm-mem of it): steps/s and the bf16
    sampler's logp_gap against the fp32-master trainer.
Random-weight models rarely emit EOS, so their completions run the full budget: the tokens/s are for full shapes.
A character tokenizer (printable ASCII) serves the random models: nothing is downloaded.
"""
import argparse
import csv
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# runs train.py as __main__ in this process, then prints the peak memory it used: torch's own count on a GPU,
# the process's max RSS on a CPU (labelled as such)
PEAK = ("import resource, runpy, sys, torch; sys.argv = ['train.py'] + sys.argv[1:]\n"
        "try:\n    runpy.run_path('train.py', run_name='__main__')\nfinally:\n"
        "    print('PEAK_GB', torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else "
        "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, flush=True)")
SHAPES = {"smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, vocab_size=49152),
          "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936),
          "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512)}


def random_model(path, tokenizer_dir, shape):
    """A random-weight Llama of SHAPES[shape] with the character tokenizer's files (its ids are < 100)."""
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=2048, tie_word_embeddings=True, pad_token_id=0,
                      eos_token_id=1, bos_token_id=None)
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config = GenerationConfig(eos_token_id=1, pad_token_id=0)
    model.save_pretrained(path)
    for f in os.listdir(tokenizer_dir):
        if "token" in f or f.endswith(".txt"):
            shutil.copy(os.path.join(tokenizer_dir, f), path)
    return path


def train_py(args, out, env=None, log=None):
    cmd = [sys.executable, "-c", PEAK, *args, "--out", out]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=log or subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def medians(out, skip=1):
    rows = [r for r in csv.DictReader(open(out + ".csv")) if int(r["step"]) > skip]
    med = lambda k: statistics.median(float(r[k]) for r in rows if r[k] != "")
    return {k: med(k) for k in ("gen_s", "train_s", "step_s", "completion_len", "logp_gap")}, len(rows)


def peak_of(text):
    lines = [line for line in text.splitlines() if line.startswith("PEAK_GB")]
    return float(lines[-1].split()[1]) if lines else float("nan")


def step_row(name, model, job, tmp, extra=()):
    t0, out = time.time(), tempfile.mktemp(dir=tmp)
    p = train_py(["--model", model, *job, *extra], out)
    text = p.communicate()[0]
    if p.returncode:
        raise RuntimeError(f"{name}: train.py failed:\n{text[-3000:]}")
    m, _ = medians(out)
    n_tok = m["completion_len"] * ROWS
    return {"row": name, "gen tok/s": n_tok / m["gen_s"], "update tok/s": n_tok / m["train_s"],
            "step_s": m["step_s"], "peak GB": peak_of(text), "steps/s": 1 / m["step_s"], "logp_gap": m["logp_gap"],
            "wall s": time.time() - t0}


def vllm_row(model, job, tmp, mem):
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"row": "trainer + vLLM worker, one GPU", "note": "vllm not installed: pip install vllm==0.33.0"}
    t0, out = time.time(), os.path.join(tmp, "async")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"NANORL_TOKEN": "gpu-check"}
    trainer = train_py([*job, "--model", model, "--role", "trainer", "--serve-host", "127.0.0.1", "--serve-port",
                        str(port)], out, env)
    worker = train_py([*job, "--model", model, "--role", "rollout", "--vllm", "--vllm-mem", str(mem), "--trainer-url",
                       f"http://127.0.0.1:{port}", "--trainer-patience", "10"], out + ".worker", env,
                      open(out + ".worker.log", "w"))
    try:
        text = trainer.communicate(timeout=600)[0]
    finally:
        worker.kill()
    if trainer.returncode:
        raise RuntimeError(f"async trainer failed:\n{text[-3000:]}\nworker: {open(out + '.worker.log').read()[-3000:]}")
    m, _ = medians(out, skip=2)
    return {"row": "trainer + vLLM worker, one GPU", "step_s": m["step_s"], "steps/s": 1 / m["step_s"],
            "logp_gap": m["logp_gap"], "peak GB": peak_of(text), "wall s": time.time() - t0,
            "note": f"peak: the trainer's; vLLM holds {mem:.0%} of the GPU"}


def main():
    global ROWS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on a CPU: the code path, not the figures")
    ap.add_argument("--smollm2", default=os.path.join(ROOT, "runs", "smollm2"), help="SmolLM2 folder, if converted")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--vllm-mem", type=float, default=0.3, help="fraction of the GPU the vLLM worker may take")
    a = ap.parse_args()
    import torch
    import transformers
    if not a.cpu and not torch.cuda.is_available():
        sys.exit("error: no CUDA device: run it on a GPU machine, or pass --cpu for the tiny CPU rehearsal")
    print(f"# {' '.join(sys.argv)}\n# machine: {torch.cuda.get_device_name() if not a.cpu else 'CPU (--cpu)'}; "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    n, g, new, steps = (2, 2, 4, 3) if a.cpu else (16, 8, 256, a.steps)
    ROWS = n * g
    job = ["--task", "countdown", "--algo", "grpo", "--n-prompts", str(n), "--group-size", str(g), "--max-new-tokens",
           str(new), "--lora", "--lora-r", "16", "--dtype", "bfloat16", "--steps", str(steps), "--eval-every", "0",
           "--solve-at", "0", "--gen-batch", str(n * g), "--micro-batch", str(min(n * g, 32))]
    from model import make_tiny_lm
    with tempfile.TemporaryDirectory() as tmp:
        chars = make_tiny_lm(os.path.join(tmp, "chars"), chars=[chr(i) for i in range(32, 127)])
        if a.cpu:
            small = big = random_model(os.path.join(tmp, "tiny"), chars, "tiny")
            label_small, label_big = "tiny (CPU rehearsal)", "tiny (CPU rehearsal)"  # one model: the rows test the path
        else:
            real = os.path.isdir(a.smollm2)
            small = a.smollm2 if real else random_model(os.path.join(tmp, "smollm2"), chars, "smollm2")
            big = random_model(os.path.join(tmp, "qwen05b"), chars, "0.5B")
            label_small = "SmolLM2-135M" + ("" if real else " (random weights, SmolLM2-shaped)")
            label_big = "0.5B-shaped (random weights)"
        print(f"# each row: python train.py --model M {' '.join(job)} [...]", flush=True)
        rows = [step_row(f"{label_small}, bf16 step", small, job, tmp),
                step_row(f"{label_big}, bf16 step", big, job, tmp),
                step_row(f"{label_big}, bf16 step, --grad-ckpt", big, job, tmp, ["--grad-ckpt"])]
        rows.append(vllm_row(small, job, tmp, a.vllm_mem) if not a.cpu else
                    {"row": "trainer + vLLM worker, one GPU", "note": "skipped with --cpu"})
    drop = rows[1]["peak GB"] - rows[2]["peak GB"]
    rows[2]["note"] = f"--grad-ckpt saves {drop:.2f} GB of the peak ({drop / rows[1]['peak GB']:.0%})"
    cols = ["gen tok/s", "update tok/s", "step_s", "steps/s", "peak GB", "logp_gap", "wall s"]
    print("| row | " + " | ".join(cols) + " | note |\n|---" * 1 + "|---" * (len(cols) + 1) + "|")
    for r in rows:
        cells = [f"{r[c]:.4g}" if c in r else "" for c in cols]
        print(f"| {r['row']} | " + " | ".join(cells) + f" | {r.get('note', '')} |")
    print(f"# peak GB: {'torch.cuda.max_memory_allocated of the train.py process' if not a.cpu else 'max RSS (CPU)'}")


if __name__ == "__main__":
    main()
