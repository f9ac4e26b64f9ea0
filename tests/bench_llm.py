"""LLM step speed: one GRPO step (8 prompts x 8 completions x 32 new tokens) for NanoRL and TRL's
GRPOTrainer side by side, on the tiny char LM and on a Qwen2-0.5B-shaped model with random weights.

    python tests/bench_llm.py [--trl-python /tmp/trl-venv/bin/python] [--steps 6] [--big-steps 1] [--models tiny]
                                # ~10 min on 2 idle CPU cores, nearly all of it the 0.5B-shaped model
    python tests/bench_llm.py --gpu          # 0.5B-shaped, 16 x 8 x 256, bf16 autocast, tokens/s

TRL is not a NanoRL dependency; install it into its own venv that reuses torch and transformers:
    python -m venv --system-site-packages /tmp/trl-venv && /tmp/trl-venv/bin/pip install trl
Each side runs in its own subprocess (so peak RSS / GPU memory is its own); times are medians over
the steps after the first (a warm-up), or the one step when only one is run (0.5B-shaped on CPU).
Prompts are MaxDigit's ("381="). EOS is made unreachable so every completion is exactly
max_new_tokens long: NanoRL stops on an id outside the vocab, TRL gets min_new_tokens. gen_s is
generation (+ reward) for NanoRL, the time inside model.generate for TRL; train_s is the rest of the
step. tok/s counts completion tokens. Both sides use micro-batches of --micro-batch rows, one
optimizer step per 64 (GPU: 128) completions, fp32 master weights. Asserts nothing about speed.
"""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRL_VENV = "/tmp/trl-venv/bin/python"
SHAPES = {"cpu": (8, 8, 32), "gpu": (16, 8, 256)}   # n_prompts, group size G, max_new_tokens
SIDES = {"cpu": "nanorl,trl-defaults,trl-fp32", "gpu": "nanorl,trl-defaults,trl-nockpt"}
TRL_ARGS = {"trl-defaults": {}, "trl-fp32": dict(bf16=False, gradient_checkpointing=False),
            "trl-nockpt": dict(gradient_checkpointing=False)}  # TRL's defaults: bf16 autocast, checkpointing


def build_models(cache):
    """The tiny char LM and a Qwen2-0.5B-shaped model (random weights, the tiny tokenizer), built once."""
    sys.path.insert(0, ROOT)
    from model import make_tiny_lm
    tiny, big = os.path.join(cache, "tiny"), os.path.join(cache, "qwen2-0.5b-shaped")
    if not os.path.isfile(os.path.join(tiny, "config.json")):
        make_tiny_lm(tiny)
    if not os.path.isfile(os.path.join(big, "config.json")):
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config
        torch.manual_seed(0)
        cfg = Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                          intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                          max_position_embeddings=32768, pad_token_id=0, eos_token_id=1, bos_token_id=None)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.generation_config = GenerationConfig(eos_token_id=1, pad_token_id=0)
        model.save_pretrained(big)
        for f in os.listdir(tiny):                      # the char tokenizer: ids >= 16 decode to ""
            if f.startswith(("tokenizer", "special_tokens")):
                shutil.copy(os.path.join(tiny, f), big)
    return {"tiny": tiny, "0.5B-shaped": big}


def peak(gpu):
    import torch
    return {"rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "gpu_gb": torch.cuda.max_memory_allocated() / 2**30 if gpu else None}


def run_nanorl(model, steps, micro_batch, gpu, bf16):
    sys.path.insert(0, ROOT)
    import torch
    import train
    n_prompts, G, new = SHAPES["gpu" if gpu else "cpu"]
    cfg = train.Config(task="maxdigit", model=model, algo="grpo", group_size=G, n_prompts=n_prompts,
                       max_new_tokens=new, loss_agg="seq", micro_batch=micro_batch, gen_batch=n_prompts * G,
                       lr=1e-5, eval_every=0, solve_at=0, dtype="bfloat16" if bf16 else "float32")
    train.validate(cfg)
    task = train.make_task(cfg)
    torch.manual_seed(0)
    policy = train.make_policy(cfg, task)
    policy.eos = [policy.model.config.vocab_size]      # never sampled: every completion is `new` tokens
    opt = train.make_optimizer(cfg, policy)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    times = []
    for step in range(1, steps + 1):
        sync(), torch.manual_seed(step)
        t0 = time.time()
        batch = train.sync_batch(task, policy, cfg, step, 0, 1).to(policy.device)
        sync()
        t1 = time.time()
        adv, target = train.ESTIMATORS["grpo"](batch, policy, std_norm=True)
        train.update(policy, opt, batch, adv, target, cfg, task.max_len)
        sync()
        times.append((t1 - t0, time.time() - t1))
        assert int(batch.mask.sum()) == n_prompts * G * new, "completions shorter than max_new_tokens"
    return times


def run_trl(model, steps, micro_batch, gpu, variant):
    import numpy as np
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    n_prompts, G, new = SHAPES["gpu" if gpu else "cpu"]
    rng = np.random.default_rng(0)
    prompts = ["".join(map(str, rng.integers(0, 10, 3))) + "=" for _ in range(2 * n_prompts * steps)]
    lengths, gen_s, step_times = [], [], []
    sync = torch.cuda.synchronize if gpu else (lambda: None)

    def reward(completions, completion_ids, **kw):     # trivial but not constant: non-zero advantages
        lengths.extend(map(len, completion_ids))
        return rng.random(len(completions)).tolist()

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    generate = net.generate

    def timed_generate(*a, **kw):
        sync()
        t = time.time()
        out = generate(*a, **kw)
        sync()
        gen_s.append(time.time() - t)
        return out
    net.generate = timed_generate

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.t, self.n_gen = time.time(), len(gen_s)

        def on_step_end(self, args, state, control, **kw):
            sync()
            step_times.append((sum(gen_s[self.n_gen:]), time.time() - self.t, len(gen_s) - self.n_gen))

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=micro_batch, num_generations=G,
                          gradient_accumulation_steps=n_prompts * G // micro_batch, max_completion_length=new,
                          generation_kwargs={"min_new_tokens": new}, temperature=1.0, beta=0.0, learning_rate=1e-5,
                          loss_type="grpo", use_vllm=False, use_cpu=not gpu, max_steps=steps, report_to="none",
                          logging_strategy="no", save_strategy="no", disable_tqdm=True, **TRL_ARGS[variant])
        trainer = GRPOTrainer(model=net, reward_funcs=reward, args=args, train_dataset=Dataset.from_dict(
            {"prompt": prompts}), processing_class=AutoTokenizer.from_pretrained(model), callbacks=[Timer()])
        trainer.train()
    assert len(lengths) == steps * n_prompts * G and set(lengths) == {new}, (len(lengths), set(lengths))
    assert all(n == 1 for _, _, n in step_times), f"expected one generate call per step: {step_times}"
    note = f"trl {trl.__version__}, bf16={args.bf16}, gradient_checkpointing={args.gradient_checkpointing}"
    return [(g, s - g) for g, s, _ in step_times], note


def worker(a):
    import torch
    torch.manual_seed(0)
    if a.side.startswith("nanorl"):
        bf16 = a.gpu or a.side == "nanorl-bf16"
        times, note = run_nanorl(a.model, a.steps, a.micro_batch, a.gpu, bf16), f"dtype {'bf16' if bf16 else 'fp32'}"
    else:
        times, note = run_trl(a.model, a.steps, a.micro_batch, a.gpu, a.side)
    timed = times[1:] or times                          # the first step is the warm-up, if there are two
    gen, upd = statistics.median(t[0] for t in timed), statistics.median(t[1] for t in timed)
    r = {"gen_s": gen, "train_s": upd, "steps": times, "note": note, **peak(a.gpu)}
    print("RESULT " + json.dumps(r), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trl-python", default=TRL_VENV if os.path.exists(TRL_VENV) else "")
    ap.add_argument("--steps", type=int, default=6, help="steps on the tiny model, the first a warm-up")
    ap.add_argument("--big-steps", type=int, help="steps on the 0.5B-shaped model, the first a warm-up if > 1 "
                    "(default 3 on GPU; 1 on CPU, where a step takes 1.5-4 min per side on 2 idle cores)")
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per forward/backward, both sides")
    ap.add_argument("--cache", default="/tmp/nanorl-bench", help="where the two models are built once")
    ap.add_argument("--models", default="tiny,0.5B-shaped", help="comma-separated subset")
    ap.add_argument("--sides", help=f"default {SIDES['cpu']} (--gpu: {SIDES['gpu']}, nanorl is bf16 there); "
                    f"also nanorl-bf16: bf16 autocast on CPU, like TRL's defaults")
    ap.add_argument("--gpu", action="store_true", help="0.5B-shaped only, 16 x 8 x 256, bf16 autocast")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # worker mode: one side, one model
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side:
        return worker(a)
    import torch
    if a.gpu and not torch.cuda.is_available():
        sys.exit("--gpu needs a CUDA device; drop --gpu for the CPU benchmark")
    models = {k: v for k, v in build_models(a.cache).items()
              if k in a.models.split(",") and not (a.gpu and k == "tiny")}
    a.big_steps = a.big_steps or (3 if a.gpu else 1)
    sides = (a.sides or SIDES["gpu" if a.gpu else "cpu"]).split(",")
    if not a.trl_python:
        print("TRL not installed: run  python -m venv --system-site-packages /tmp/trl-venv && "
              "/tmp/trl-venv/bin/pip install trl   (TRL rows skipped)")
        sides = [s for s in sides if s.startswith("nanorl")]
    n_prompts, G, new = SHAPES["gpu" if a.gpu else "cpu"]
    print(f"one GRPO step, {n_prompts} prompts x {G} x {new} new tokens, micro-batch {a.micro_batch}, "
          f"{'GPU' if a.gpu else 'CPU'}; median over steps after the first (tiny: {a.steps} steps, 0.5B-shaped: "
          f"{a.big_steps}; one step: no warm-up)")
    print(f"{'side':13} {'model':12} {'gen_s':>7} {'train_s':>8} {'step_s':>7} {'gen tok/s':>9} {'upd tok/s':>9} "
          f"{'peak RSS GB':>11} {'peak GPU GB':>11}")
    for name, path in models.items():
        steps = a.steps if name == "tiny" else a.big_steps
        for side in sides:
            py = sys.executable if side.startswith("nanorl") else a.trl_python
            cmd = [py, os.path.abspath(__file__), "--side", side, "--model", path, "--steps", str(steps),
                   "--micro-batch", str(a.micro_batch)] + ["--gpu"] * a.gpu
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if p.returncode or not line:
                print(f"{side:13} {name:12} FAILED (exit {p.returncode}): {p.stderr.strip()[-600:]}", flush=True)
                continue
            r = json.loads(line[0][7:])
            tok, step = n_prompts * G * new, r["gen_s"] + r["train_s"]
            gpu_gb = f"{r['gpu_gb']:11.2f}" if r["gpu_gb"] is not None else f"{'-':>11}"
            print(f"{side:13} {name:12} {r['gen_s']:7.2f} {r['train_s']:8.2f} {step:7.2f} {tok / r['gen_s']:9.0f} "
                  f"{tok / r['train_s']:9.0f} {r['rss_gb']:11.2f} {gpu_gb}   {r['note']}; per step (gen_s, train_s): "
                  + " ".join(f"({g:.2f}, {u:.2f})" for g, u in r["steps"]), flush=True)


if __name__ == "__main__":
    main()
