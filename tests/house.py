"""This project's house rules, for its maintainers: .ci/run checks them, the test suite does not (a fork that
adds a task, an estimator or a tool should not see the project's own tests go red for its added lines).

    python tests/house.py            # the seven modules within the ratchet, the README's line counts theirs,
                                     # every shipped preset shown in the README and headed
    python tests/house.py --write    # rewrite the README's table of line counts from the files (a fork:
                                     # after a change; the ratchet is this project's, a fork may ignore it)

Stdlib only. Exit status 1, saying what is over, when a check fails.
"""
import ast
import glob
import io
import os
import re
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
MODULES = ["core", "utils", "algos", "model", "tasks", "serve", "train"]

# The ratchet: what the seven modules measure now, in the budget's units (python ../shared/tools/size.py: code
# tokens exclude comments and docstrings, so an explaining comment is free and a joined line saves nothing).
# Lower a number as the code shrinks; raise one only as far as an issue's allowance says (its closing note and
# `git log -p tests/house.py` keep the history). The budget: 24,750 tokens, 2,650 non-blank lines, 110
# characters, functions <= 60 lines (train() excepted), classes <= 150.
# Issue 31 (23,498 -> 24,597 tokens, 2,497 -> 2,650 lines) spent ~950 tokens past its +150: the stop that saves
# from a thread (~430), the teacher's checks, term and scale, --export's refusals, one message per rule. Owed.
# Issue 32 (24,597 -> 24,713, within its +300): its three mechanisms cost ~530 tokens and ~60 lines, paid by
# removing --report-to (~415 tokens, ~35 lines) and trimming prose; the budget's lines are all spent.
# Issue 33 (24,713 -> 25,317 tokens, 2,649 -> 2,705 lines): ~250 tokens past its +350, and past the budget's
# 24,750 and 2,650. --teacher self's scoring (self_taught, ~300), the privileged prompts of five tasks, the
# two-token task, the control task, the trainer drawing a lease's problems again (~300 together). A search
# of model, serve, utils, core and algos for honest cuts found 7 tokens (taken). Owed, with issue 31's.
# Issue 34 (25,317 -> 26,696 tokens, 2,705 -> 2,901 lines): ~930 tokens past its +450. Environment objects
# with reset/step stepped in batches on threads, their failures and rewards (take_turns, concurrently, play's
# resets and closes, the samplers' batched turns: ~600), the OpenEnv task and its session (~360), the turn
# cap in both samplers, the system prompt, the transcript, scoring by the environment. A search of train and
# serve for honest cuts found 48 tokens (taken); what is left would remove features. Owed, with 31's and 33's.
RATCHET = {"tokens": 26696, "nonblank": 2901, "width": 110, "func": 60, "class": 148}


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


def config_problems(readme):
    """The shipped presets (configs/*.yaml): each shown in the README and opening with its header (the rung,
    then hardware, expected result and metric, and its # Run: line) -> what is missing. A fork's own presets go
    in configs/ too: the suite smoke-runs every one there, and these rules are this project's, not a fork's."""
    problems = []
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))):
        name, head = os.path.basename(path), open(path).read().splitlines()[:12]
        if f"configs/{name}" not in readme:
            problems.append(f"README never shows configs/{name}")
        if not (head and head[0].startswith("# Rung") and any("Expected" in h for h in head[:5])
                and any(h.startswith("# Run:") for h in head)):
            problems.append(f"configs/{name}'s header: '# Rung ...', 'Expected' within 5 lines, a '# Run:' line")
    return problems


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
    problems += config_problems(readme)
    for p in problems:
        print("house rules: " + p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
