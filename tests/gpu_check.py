"""GPU check, ready for the day a GPU machine is lent: one table, ~5.5 minutes expected on one H200, stopped at 8.
NOT RUN ON A GPU YET: its H200 times (GUESS) are guesses until it has.

    python tests/gpu_check.py [--smollm2 runs/smollm2]   # a CUDA machine (vLLM optional: pip install vllm)
    python tests/gpu_check.py --cpu                      # the same code path on a CPU, tiny shapes, ~30 s

Each part is a real `python train.py` process (GRPO on Countdown, LoRA r=16, bf16, 16 prompts x 8 samples x 256 new
tokens, eval off) and its figures are medians of the per-step CSV train.py writes, over the steps after the first:
  1. SmolLM2-135M-Instruct (--smollm2 DIR; without its weights, a random-weight model of its shape) and
  2. a Qwen2-0.5B-shaped random-weight Llama (hidden 896, 24 layers, 14 heads, 2 KV heads, vocab 151936, tied; Qwen2's
     q/k/v biases left out): generation and update tokens/s, step_s and the process's peak GPU memory;
  3. part 2 with --grad-ckpt: the drop in that peak is the activation memory it saves;
  4. a trainer and one --vllm worker sharing the GPU (vLLM capped at --vllm-mem of it): steps/s and the bf16
     sampler's logp_gap against the trainer's scoring.
Random weights rarely sample EOS, so their completions run the whole budget: full shapes. Their tokenizer is the
--smollm2 folder's when it has one (3.5 MB: carry it to a machine without the weights), else a character tokenizer
(printable ASCII, no chat template: a Countdown prompt is ~245 tokens, against 109 with SmolLM2's). Nothing is
downloaded: the GPU machine has no internet.
"""
import argparse
import contextlib
import csv
import importlib.metadata
import importlib.util
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# train.py run as __main__ inside this wrapper, which prints the process's peak memory as train.py exits (a Ctrl-C or
# SIGTERM too: train.py turns both into SystemExit). GPU: torch.cuda.max_memory_allocated, the tensors torch allocated
# (not the ~0.5 GB CUDA context, nor the allocator's cached slack). CPU: ru_maxrss, the process's max resident set.
PEAK = ("import resource, runpy, sys, torch; sys.argv = ['train.py'] + sys.argv[1:]\n"
        "try:\n    runpy.run_path('train.py', run_name='__main__')\nfinally:\n"
        "    print('PEAK_GB', torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else "
        "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, flush=True)")  # ru_maxrss is in KB on Linux
SHAPES = {"smollm2": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                      "num_key_value_heads": 3, "vocab_size": 49152},
          "0.5B": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                   "num_key_value_heads": 2, "vocab_size": 151936},
          "tiny": {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": 512}}
# seconds per part, process start to exit: guesses for an H200 (not measured), and what --cpu takes on 2 busy cores
GUESS = {"gpu": {"build": 20, "smollm2": 40, "0.5B": 50, "ckpt": 60, "vllm": 150},
         "cpu": {"build": 5, "smollm2": 8, "0.5B": 8, "ckpt": 8, "vllm": 15}}
PARTS = ["smollm2 bf16 step", "0.5B-shaped bf16 step", "0.5B-shaped bf16 step, --grad-ckpt",
         "vLLM worker + trainer, async"]
COLS = ["gen tok/s", "update tok/s", "step_s", "steps/s", "peak GB", "logp_gap", "steps", "wall s"]


def random_model(path, tokenizer_dir, shape):
    """A random-weight bf16 Llama of SHAPES[shape] with tokenizer_dir's tokenizer (whose ids must fit its vocab)."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
    )
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tok) <= SHAPES[shape]["vocab_size"], (len(tok), shape)
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=2048, tie_word_embeddings=True, pad_token_id=pad,
                      eos_token_id=eos, bos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)  # --lora keeps the frozen base in bf16 anyway
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(path)
    tok.save_pretrained(path)                           # tokenizer.json, its config and the chat template, if any
    return path


def read(path) -> str:
    """The file's text, "" if it is not there (yet)."""
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()


def launch(args, out, env=None, session=False):
    """python train.py ARGS --out OUT inside PEAK, its stdout and stderr in OUT.log."""
    with open(out + ".log", "w") as log:                # the child holds its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-c", PEAK, *args, "--out", out], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=session)


def stop(p, grace=60):
    """SIGTERM (train.py checkpoints and exits, PEAK prints), then SIGKILL if it outlives the grace."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def step_part(args, out, timeout):
    """One sync train.py run -> its row's cells; at its time limit it is stopped and the steps it logged count."""
    t0, p = time.time(), launch(args, out)
    try:
        if p.wait(timeout):
            raise RuntimeError(f"train.py exited {p.returncode}")
        note = ""
    except subprocess.TimeoutExpired:
        stop(p)
        note = f"stopped at its {timeout:.0f} s limit"
    return measure(out, time.time() - t0, note)


def vllm_part(args, worker_args, out, timeout):
    """A trainer (port 0: it logs the one it got) and, once it serves, one --vllm worker, both on this GPU."""
    t0, env, worker = time.time(), {"NANORL_TOKEN": "gpu-check"}, None
    trainer = launch([*args, "--role", "trainer", "--serve-host", "127.0.0.1", "--serve-port", "0",
                      "--batch-timeout", str(int(timeout))], out, env)
    try:
        while time.time() - t0 < timeout and trainer.poll() is None and (worker is None or worker.poll() is None):
            port = [line.split(":")[-1].strip() for line in read(out + ".log").splitlines()
                    if line.startswith("trainer: serving on")]
            if port and worker is None:                 # its own process group: vLLM's engine is a child process
                worker = launch([*args, *worker_args, "--trainer-url", f"http://127.0.0.1:{port[0]}"], out + ".worker",
                                env, session=True)
            time.sleep(1)
        died = (f"the trainer exited {trainer.returncode}" if trainer.poll() else "" if trainer.poll() == 0 else
                f"the worker exited {worker.returncode}" if worker is not None and worker.poll() is not None else "")
    finally:
        stop(trainer)
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):  # the trainer is done: nothing is left to generate
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    if died:
        raise RuntimeError(died)
    return measure(out, time.time() - t0, "" if trainer.returncode == 0 else f"stopped at its {timeout:.0f} s limit")


def measure(out, wall, note, skip=1):
    """The CSV's steps after the first `skip` (warm-up; all of them if no more were logged) -> the row's cells.
    A run that ended early (note) still gives the steps it logged; none at all is a failure."""
    rows = list(csv.DictReader(read(out + ".csv").splitlines()))
    rows = [r for r in rows if int(r["step"]) > skip] or rows
    if not rows:
        raise RuntimeError(note or "no step logged")
    med = lambda k: statistics.median([float(r[k]) for r in rows if r[k] != ""] or [math.nan])
    n_tok = med("tokens_per_s") * med("step_s")         # completion tokens per step (the mask's sum, all rows)
    peak = [line.split()[1] for line in read(out + ".log").splitlines() if line.startswith("PEAK_GB")]
    return {"gen tok/s": n_tok / med("gen_s"), "update tok/s": n_tok / med("train_s"), "step_s": med("step_s"),
            "steps/s": 1 / med("step_s"), "peak GB": float(peak[-1]) if peak else math.nan,
            "logp_gap": med("logp_gap"), "steps": len(rows), "wall s": wall, "staleness": med("staleness"),
            "note": note + ": " * bool(note)}


def run_part(name, fn, out, timeout, *args):
    """fn(*args, out, timeout) -> the row's cells; a failure becomes the row's note, its logs' tails go to stderr,
    and the check goes on to the next part."""
    try:
        return fn(*args, out, timeout)
    except (RuntimeError, OSError) as e:
        logs = "".join(f"\n--- {f}:\n{read(f)[-3000:]}" for f in (out + ".log", out + ".worker.log") if read(f))
        print(f"\n--- {name} failed: {e}{logs}", file=sys.stderr)
        return {"note": f"FAILED: {e}"}


def job(n, g, new, steps):
    return ["--task", "countdown", "--algo", "grpo", "--n-prompts", str(n), "--group-size", str(g),
            "--max-new-tokens", str(new), "--lora", "--lora-r", "16", "--dtype", "bfloat16", "--steps", str(steps),
            "--eval-every", "0", "--solve-at", "0", "--gen-batch", str(n * g), "--micro-batch", str(min(n * g, 32))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on a CPU: the code path, not the figures")
    ap.add_argument("--smollm2", default=os.path.join(ROOT, "runs", "smollm2"), help="SmolLM2-135M-Instruct folder")
    ap.add_argument("--steps", type=int, default=4, help="steps per sync part (the first, warm-up, is left out)")
    ap.add_argument("--vllm-mem", type=float, default=0.3, help="fraction of the GPU the vLLM worker may take")
    ap.add_argument("--budget-s", type=float, default=0, help="parts are stopped so that the whole check fits "
                                                              "(0: 480 s on a GPU, 150 s with --cpu)")
    a = ap.parse_args()
    import torch
    import transformers
    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" bars, in this process only
    if not a.cpu and not torch.cuda.is_available():
        sys.exit("error: no CUDA device: run it on a GPU machine, or pass --cpu for the tiny CPU rehearsal")
    t0, guess = time.time(), GUESS["cpu" if a.cpu else "gpu"]
    deadline = t0 + (a.budget_s or (150 if a.cpu else 480))
    vllm = importlib.util.find_spec("vllm") is not None
    print(f"# python {shlex.join(sys.argv)}\n# machine: " + ("CPU (--cpu)" if a.cpu else
          f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
          + f"; torch {torch.__version__}, transformers {transformers.__version__}, vllm "
          + (importlib.metadata.version("vllm") if vllm else "not installed"), flush=True)
    shape = (2, 2, 4) if a.cpu else (16, 8, 256)
    with tempfile.TemporaryDirectory() as tmp:
        models = build_models(a, tmp, guess["build"])
        plan = [("smollm2", models["smollm2"], []), ("0.5B", models["0.5B"], []),
                ("ckpt", models["0.5B"], ["--grad-ckpt"])]
        rows = []
        for i, (key, (path, label), extra) in enumerate(plan):
            args = ["--model", path, *job(*shape, 3 if a.cpu else a.steps), *extra]
            announce(i, label, guess[key], a.cpu, "python train.py " + shlex.join(args))
            timeout = left(deadline, guess, plan[i + 1:])
            rows.append({"part": PARTS[i], "model": label,
                         **run_part(PARTS[i], step_part, os.path.join(tmp, key), timeout, args)})
        async_job = job(*shape, 4 if a.cpu else a.steps + 2)      # its step 1 waits for the worker's start-up
        out = os.path.join(tmp, "async")
        rows.append(vllm_row(a, vllm, models["smollm2"], async_job, out, deadline, guess["vllm"]))
    ckpt_note(rows)
    print_table(rows, a.cpu, time.time() - t0)
    return int(any(r["note"].startswith("FAILED") for r in rows))


def left(deadline, guess, later):
    """A part's time limit: what is left of --budget-s but the guesses of the parts after it (10 s at least)."""
    return max(10.0, deadline - time.time() - sum(guess[k] for k, _, _ in later) - guess["vllm"])


def announce(i, label, guess, cpu, cmd):
    print(f"# part {i + 1}/4, {PARTS[i]} ({label}): ~{guess} s expected "
          f"({'on 2 busy CPU cores' if cpu else 'an H200 guess, not measured'}" + (", vLLM's start-up included"
          if i == 3 and not cpu else "") + f")\n#   {cmd}", flush=True)


def build_models(a, tmp, guess):
    """{part: (path, label)}: SmolLM2 itself where its weights are, else random weights of its shape; 0.5B-shaped
    random weights; --cpu: one tiny random LM for every part (the rows test the code path, not the figures)."""
    from model import make_tiny_lm
    t0 = time.time()
    print(f"# building the random-weight models: ~{guess} s expected", flush=True)
    chars = make_tiny_lm(os.path.join(tmp, "chars"), chars=[chr(i) for i in range(32, 127)])
    if a.cpu:
        tiny = (random_model(os.path.join(tmp, "tiny"), chars, "tiny"), "tiny random LM (CPU)")
        return {"smollm2": tiny, "0.5B": tiny}
    has = lambda f: os.path.isfile(os.path.join(a.smollm2, f))
    tokenizer = a.smollm2 if has("tokenizer.json") else chars
    real = has("config.json") and any(f.endswith(".safetensors") for f in os.listdir(a.smollm2))
    tok = "SmolLM2's tokenizer" if tokenizer == a.smollm2 else "character tokenizer"
    models = {"smollm2": (a.smollm2, "SmolLM2-135M-Instruct") if real else
              (random_model(os.path.join(tmp, "smollm2"), tokenizer, "smollm2"),
               f"random weights, SmolLM2-shaped, {tok}"),
              "0.5B": (random_model(os.path.join(tmp, "qwen05b"), tokenizer, "0.5B"),
                       f"random weights, Qwen2-0.5B-shaped, {tok}")}
    print(f"#   built in {time.time() - t0:.0f} s", flush=True)
    return models


def vllm_row(a, vllm, model, args, out, deadline, guess):
    """Part 4: the trainer and a --vllm worker; --cpu rehearses the same two processes with an HF worker."""
    (path, label), row = model, {"part": PARTS[3], "model": model[1]}
    if not (a.cpu or vllm):
        return {**row, "note": "vllm not installed (pip install vllm)"}
    worker = ["--role", "rollout", *([] if a.cpu else ["--vllm", "--vllm-mem", str(a.vllm_mem)])]
    announce(3, label, guess, a.cpu, f"NANORL_TOKEN=.. python train.py --model {path} {shlex.join(args)} "
             f"--role trainer --serve-port 0 & python train.py [the same] {shlex.join(worker)} --trainer-url URL")
    cells = run_part(PARTS[3], vllm_part, out, max(10.0, deadline - time.time()), ["--model", path, *args], worker)
    if "staleness" in cells:                           # gen_s here is the trainer's wait for a batch: no tok/s
        cells = {k: v for k, v in cells.items() if "tok/s" not in k}
        cells["note"] += (f"staleness {cells['staleness']:.2g}; peak: the trainer's, "
                          + ("an HF worker: no vllm (--cpu)" if a.cpu else f"vLLM holds {a.vllm_mem:.0%} of the GPU"))
    return {**row, **cells}


def ckpt_note(rows):
    base, ckpt = rows[1].get("peak GB", math.nan), rows[2].get("peak GB", math.nan)
    if math.isfinite(base) and math.isfinite(ckpt):
        rows[2]["note"] += f"--grad-ckpt saves {base - ckpt:.3g} GB of the peak ({(base - ckpt) / base:.0%})"


def print_table(rows, cpu, wall):
    cell = lambda r, c: f"{r[c]:.4g}" if c in r and math.isfinite(r[c]) else ""
    print("\n| part | model | " + " | ".join(COLS) + " | note |\n" + "|---" * (len(COLS) + 3) + "|")
    for r in rows:
        print(f"| {r['part']} | {r['model']} | " + " | ".join(cell(r, c) for c in COLS) + f" | {r['note']} |")
    print("\nmedians over the steps after the first; tok/s: completion tokens per step (the CSV's tokens_per_s x "
          "step_s) / gen_s or train_s; peak GB: " + ("max RSS of the train.py process (ru_maxrss), not GPU memory"
          if cpu else "torch.cuda.max_memory_allocated() in the train.py process (tensors only)")
          + f". The whole check: {wall:.0f} s.")


if __name__ == "__main__":
    sys.exit(main())
