"""This project's house rules, for its maintainers: .ci/run checks them, the test suite does not (a fork that
adds a task, an estimator or a tool should not see the project's own tests go red for its added lines).

    python tests/house.py            # the seven modules within the ratchet, the README's line counts theirs
    python tests/house.py --write    # rewrite the README's table of line counts from the files (a fork:
                                     # after a change; the ratchet is this project's, a fork may ignore it)

Stdlib only. Exit status 1, saying what is over, when a check fails.
"""
import ast
import io
import os
import re
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
MODULES = ["core", "utils", "algos", "model", "tasks", "serve", "train"]

# The ratchet: what the seven modules measure now, in the budget's units (python ../shared/tools/size.py:
# code tokens exclude comments and docstrings, so an explaining comment is free and a joined line saves
# nothing). Lower a number as the code shrinks; never raise one. The budget they head for: 19,000 tokens,
# 2,000 non-blank lines, 110 characters, functions <= 60 lines (train() excepted), classes <= 150.
# Raised once, nonblank 2374 -> 2405: tool use (issue 15) added ~100 lines and ~70 were won back elsewhere;
# the rest are its explaining comments and docstrings (its code tokens were all won back: 22439 -> 22413).
# Issue 14's fourth step reached 21,512 / 2,310; issue 16 (samples.jsonl, --report-to) then spent ~890 tokens
# of that room: 22413 -> 22404 tokens, 2405 -> 2394 lines, nothing raised.
# Raised by issue 22, which was to add no net code tokens and did not pay its cost back yet: 22404 -> 22817
# tokens, 2394 -> 2482 lines (the stop within seconds under torchrun, choices checked in validate(), the
# stranger's byte cap, the port/YAML/tool errors, the samples group, this checkout's pid files). Owed.
# Issue 23 (distillation, +539 tokens as written) landed with 316 tokens of simplification elsewhere (Batch.group_id,
# masked_mean, the .adapter copy, serve/model/tasks/train passes) and issue 24's linear tool-call search (+56):
# 22817 -> 23096 tokens, 2482 -> 2498 lines (the 2,500 budget). Still owed to issues 22 + 23's allowance: ~190
# tokens. HFPolicy 139 -> 143 lines: the tool-reply loop inlined into _generate (one caller).
# A payback (unused parameters and defaults, one-caller helpers folded, scalar state as class defaults):
# 23096 -> 22936 tokens, 2498 -> 2497 lines; still owed: ~30 tokens.
# Issue 24's turns, scoring rule and vLLM engine loop (+~860 as first written), paid for down to the budget by
# three passes over all seven modules (-380: one-caller helpers folded, prose tightened): 22936 -> 23497 tokens,
# 2497 -> 2493 lines. Issues 22 + 23 + 24 together hold their allowances (22,404 + 0 + 450 + 650 = 23,504); the
# Guess game and its rung (branch turns-rung, ~160 tokens) still have to be paid for. HFPolicy 143 -> 145 lines.
# The Guess game (+~125 tokens, +19 lines) paid for by three more passes (-126 tokens: one flag read once,
# dict merges, redundant conversions, parameters never passed; -14 lines of prose said twice): 23497 -> 23497
# tokens, 2493 -> 2497 lines, within the 2,500. HFPolicy 145 -> 144 lines.
# The trainer listens only once version 1 is published (an /info before named no weights; a vLLM worker refused):
# the port error moved into WireServer.start, 23497 -> 23498 tokens (issue 24: +543 of its 650), 2497 lines.
RATCHET = {"tokens": 23498, "nonblank": 2497, "width": 110, "func": 60, "class": 144}


def code_tokens(src: str) -> int:
    """Python tokens that are neither comments nor docstrings (a string standing alone as a statement)."""
    n, prev = 0, None
    for t in tokenize.generate_tokens(io.StringIO(src).readline):
        docstring = t.type == tokenize.STRING and prev in (
            tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE, None)
        layout = t.type in (
            tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
        n += not (docstring or layout or t.type == tokenize.COMMENT)
        prev = prev if t.type in (tokenize.NL, tokenize.COMMENT) else t.type
    return n


def measure():
    """-> (the ratchet's measures over the seven modules, {module: non-blank lines})."""
    got, lines = dict.fromkeys(RATCHET, 0), {}
    for m in MODULES:
        src = open(os.path.join(ROOT, m + ".py")).read()
        lines[m] = sum(1 for line in src.splitlines() if line.strip())
        got["tokens"] += code_tokens(src)
        got["nonblank"] += lines[m]
        got["width"] = max(got["width"], *map(len, src.splitlines()))
        for node in ast.walk(ast.parse(src)):
            kind = "class" if isinstance(node, ast.ClassDef) else "func" if isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
            if kind and not (kind == "func" and m == "train" and node.name == "train"):  # the loop: longer
                got[kind] = max(got[kind], node.end_lineno - node.lineno + 1)
    return got, lines


def with_counts(readme, lines):
    """The README with its "What is in it" table's counts (`| core.py | 70 |`, `| total |`) set to lines."""
    readme = re.sub(r"^(\| (\w+)\.py \| )\d+ \|",
                    lambda m: f"{m[1]}{lines[m[2]]} |" if m[2] in lines else m[0], readme, flags=re.M)
    return re.sub(r"^(\| total \| )\d+ \|", lambda m: f"{m[1]}{sum(lines.values())} |", readme, flags=re.M)


def main(argv):
    got, lines = measure()
    readme = open(README).read()
    if "--write" in argv:
        open(README, "w").write(with_counts(readme, lines))
        print(f"README.md: line counts {lines}, total {sum(lines.values())}")
        return 0
    print(f"the seven modules: {got} (ratchet {RATCHET})")
    problems = [f"{k} {got[k]} is over the ratchet's {RATCHET[k]}: delete before adding"
                for k in RATCHET if got[k] > RATCHET[k]]
    if with_counts(readme, lines) != readme or not re.search(r"^\| total \| \d+ \|", readme, re.M):
        problems.append(f"README.md's table of line counts is not the files' {lines}: "
                        f"python tests/house.py --write rewrites it")
    for p in problems:
        print("house rules: " + p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
