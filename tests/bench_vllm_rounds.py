"""vLLM with the calculator on: chains of thought with many '=' (SmolLM2-135M-Instruct, greedy, --max-tool-calls
1), the previous VLLMGenerator.act and today's side by side on one engine, the same prompts. Before (the act of
git revision --rev, loaded from git): every '=' ended a request, even with no call left to make, and each round
of generate() waited for its slowest sample. Now: a request stops only where a reply can follow (a call left),
and the request that goes on enters the engine at once.

    . .venv-vllm/bin/activate && python tests/bench_vllm_rounds.py [--smollm2 runs/smollm2] [--rev bf0331b]

SmolLM2's folder as in tests/bench_llm.py. Prints, per side: engine requests, generate() rounds (before), the
'=' and tool replies in the completions, tokens, and wall seconds, median [min-max] over --repeats. Asserts that
both sides give the same completions (greedy, the same engine); nothing about speed.
"""
import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# GSM8K-style: the model writes a step per line, each an equation; SmolLM2 continues such chains for dozens
PROMPT = ("Count up by {step}, starting at {start}, writing each step as an equation on its own line: "
          "{start} + {step} = {next}, then {next} + {step} = ..., and so on, 30 steps.")


def load_before(rev):
    """model.py as it was at `rev`, imported as a module of its own."""
    src = subprocess.run(["git", "show", f"{rev}:model.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    path = os.path.join(tempfile.mkdtemp(), "model_before.py")
    with open(path, "w") as f:
        f.write(src.stdout)
    spec = importlib.util.spec_from_file_location("model_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--smollm2", default=os.environ.get("NANORL_SMOLLM2", os.path.join(ROOT, "runs", "smollm2")))
    cli.add_argument("--rev", default="bf0331b", help="the git revision whose act() is 'before'")
    cli.add_argument("--prompts", type=int, default=8)
    cli.add_argument("--max-new-tokens", type=int, default=400)
    cli.add_argument("--repeats", type=int, default=3)
    a = cli.parse_args()
    from model import VLLMGenerator
    from tasks import Multiply
    before = load_before(a.rev)
    task = Multiply(eval_episodes=2, max_new_tokens=a.max_new_tokens, max_tool_calls=1)   # reply(): the calculator
    gen = VLLMGenerator(a.smollm2, lora_r=8, prompt_len=lambda encode: 96, max_new_tokens=a.max_new_tokens,
                        dtype="float32")
    engine, counts = gen.llm.llm_engine, {"requests": 0, "rounds": 0}
    add, generate = engine.add_request, gen.llm.generate

    def counted_add(*args, **kw):
        counts["requests"] += 1
        return add(*args, **kw)

    def counted_generate(*args, **kw):
        counts["rounds"] += 1
        return generate(*args, **kw)
    engine.add_request, gen.llm.generate = counted_add, counted_generate
    ids = [gen.encode(PROMPT.format(start=3 + 7 * i, step=2 + i % 5, next=3 + 7 * i + 2 + i % 5))
           for i in range(a.prompts)]
    sides = {"before": lambda: before.VLLMGenerator.act(gen, ids, 1, True, task),
             "now": lambda: gen.act(ids, 1, greedy=True, env=task)}
    results = {}
    for repeat in range(a.repeats):                     # alternated, so that both sides see the same machine
        for name, act in sides.items():
            counts.update(requests=0, rounds=0)
            t0 = time.perf_counter()
            out = act()
            results.setdefault(name, []).append((time.perf_counter() - t0, dict(counts), out))
    completions = {name: [[c.tolist() for c, *_ in r[2]] for r in runs] for name, runs in results.items()}
    assert completions["before"][0] == completions["now"][0], "the two sides sampled different completions"
    texts = [gen.decode(c) for c in completions["now"][0]]
    print(f"{a.prompts} prompts, greedy, --max-new-tokens {a.max_new_tokens}, --max-tool-calls 1; "
          f"'=' per completion: {[t.count('=') for t in texts]}, tool replies: "
          f"{[t.count('<result>') for t in texts]}, tokens: {[len(c) for c in completions['now'][0]]}")
    for name, runs in results.items():
        s = sorted(t for t, *_ in runs)
        print(f"{name:>6}: {runs[0][1]['requests']:4d} engine requests, {runs[0][1]['rounds']:3d} generate() rounds, "
              f"{statistics.median(s):6.2f} s [{s[0]:.2f}-{s[-1]:.2f}] over {len(s)} runs")
    print("first completion:", repr(texts[0][:300]))
    gen.llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
