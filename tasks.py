"""Tasks: sample(n, rng) -> prompts, rollout(policy, prompts, group_size) -> Batch, evaluate(policy) -> dict.
Invariants: training and held-out prompts are disjoint by construction; a group shares a prompt (a seed)."""
import ast
import concurrent.futures
import hashlib
import inspect
import itertools
import json
import operator
import os
import re
import sys
import threading
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import torch

from core import Batch, Trajectory
from utils import all_sum

EVAL_SEED0 = 2**31  # held-out CartPole seeds are EVAL_SEED0 + i; training seeds are < 2**31


class CartPole:
    """CartPole-v1, numpy, vectorised: all episodes step together, one policy forward per time step.
    Dynamics, thresholds, the 500-step truncation and the reset match gymnasium's, step for step."""
    obs_dim, n_actions, max_len, metric, is_llm = 4, 2, 500, "eval_return", False
    reward_range = (0.0, 500.0)                 # an episode's return: +1 per step, 500 steps at most
    gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    x_limit, theta_limit = 2.4, 12 * 2 * np.pi / 360

    def __init__(self, eval_episodes=16):
        self.eval_episodes = eval_episodes

    def sample(self, n, rng):
        return rng.integers(EVAL_SEED0, size=n).tolist()

    def step(self, s, a):
        """Euler step of the Barto-Sutton-Anderson cart-pole. s [N, 4] float64, a [N] -> s' [N, 4]."""
        _, x_dot, th, th_dot = s.T
        total_mass, pml = self.masspole + self.masscart, self.masspole * self.length
        force = self.force_mag * (2 * a - 1)                                # action 1 pushes right, 0 left
        cos, sin = np.cos(th), np.sin(th)
        temp = (force + pml * th_dot**2 * sin) / total_mass
        th_acc = (self.gravity * sin - cos * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * cos**2 / total_mass))
        x_acc = temp - pml * th_acc * cos / total_mass
        return s + self.tau * np.stack([x_dot, x_acc, th_dot, th_acc], 1)     # Euler: s + tau * ds/dt

    def rollout(self, policy, prompts, group_size, greedy=False):
        seeds = np.repeat(prompts, group_size)                              # groups contiguous
        s = np.stack([np.random.default_rng(seed).uniform(-0.05, 0.05, 4) for seed in seeds])  # [N, 4]
        steps = []                                                          # (obs, action, logp) per step
        alive, length = np.ones(len(s), bool), np.zeros(len(s), int)
        for _ in range(self.max_len):
            o = s.astype(np.float32)                                         # gymnasium's obs dtype
            a, lp = policy.act(o, greedy)
            steps.append((o, a, lp))
            s = np.where(alive[:, None], self.step(s, a), s)                 # finished rows stay put
            length += alive
            alive &= (np.abs(s[:, [0, 2]]) <= [self.x_limit, self.theta_limit]).all(1)    # x and theta
            if not alive.any():
                break
        obs, acts, logps = (torch.from_numpy(np.stack(x, 1)) for x in zip(*steps))  # [N, T, ...]
        final = torch.from_numpy(s.astype(np.float32))                      # [N, 4]
        rows = [Trajectory(states=obs[i, :L], actions=acts[i, :L], logp=logps[i, :L],
                           rewards=torch.ones(L), mask=torch.ones(L), truncated=bool(alive[i]),
                           final_state=final[i]) for i, L in enumerate(length.tolist())]
        return Batch.from_rows(rows, group_size)

    def evaluate(self, policy, rank=0, world=1):
        """Greedy return on the held-out seeds, all episodes at once; ranks split them and sum."""
        seeds = range(EVAL_SEED0 + rank, EVAL_SEED0 + self.eval_episodes, world)
        total = self.rollout(policy, seeds, 1, greedy=True).rewards.sum().item() if seeds else 0.0
        return {"eval_return": all_sum(total) / self.eval_episodes}


# ---- LLM tasks: pure reward functions (prompt, completion, answer) -> float, never raising ----

MAX_EXPR = 200  # characters: 4 two-digit numbers, 3 ops, parentheses and spaces fit in ~40
_EXPR_CHARS = set("0123456789+-*/() ")  # explicit ASCII: str.isdigit() also accepts '３' and '٣'
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
# thousands groups first, so "1,234" is one number but "1, 2" is two; [0-9], not \d (unicode digits)
_NUMBER = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?")


def extract_answer(completion):
    """Text inside the LAST <answer>...</answer> pair, stripped; None without a pair.
    rfind, not a regex: a non-greedy pattern is quadratic on 100k characters of '<answer>'."""
    end = completion.rfind("</answer>")
    start = completion.rfind("<answer>", 0, max(end, 0))         # -1 too when there is no </answer>
    return None if start < 0 else completion[start + len("<answer>"):end].strip()


def format_reward(prompt, completion, answer):
    """0.5 for an <answer>...</answer> pair, +0.5 if only whitespace follows its closing tag."""
    if extract_answer(completion) is None:
        return 0.0
    return 0.5 + 0.5 * completion.rstrip().endswith("</answer>")


def _evaluate(expr):
    """Exact Fraction value, parsed, never run, of an expression already checked to be at most MAX_EXPR ASCII
    digits, + - * / ( ) and spaces (~100 nested parentheses: inside the parser's and this recursion's limits).
    None on a syntax error ('3 4', unbalanced), on x/0 or on another node ('-3', '**', '//', '3(4)', '()')."""

    def value(node):
        if isinstance(node, ast.Constant):              # only digits get here: an int
            return Fraction(node.value)
        return _OPS[type(node.op)](value(node.left), value(node.right))   # '-3': KeyError; '3(4)': no .op

    try:
        return value(ast.parse(expr, mode="eval").body)
    except (SyntaxError, AttributeError, KeyError, ZeroDivisionError):
        return None


def countdown_reward(prompt, completion, answer):
    """1.0 iff the last <answer> is an expression of ASCII digits, + - * / ( ) and spaces using the given
    numbers once each (as a multiset; none split, joined or '07') equal to the target exactly (7/2*2 == 7)."""
    expr = extract_answer(completion)
    if expr is None or len(expr) > MAX_EXPR or not set(expr) <= _EXPR_CHARS:
        return 0.0
    # as strings: a number written '07' matches no str(number); checked before evaluating: values stay small
    return float(sorted(re.findall("[0-9]+", expr)) == sorted(map(str, answer["numbers"]))
                 and _evaluate(expr) == answer["target"])


def calculator(expr):
    """The calculator tool: + - * / ( ) on integers, exact (Countdown's evaluator: parsed, never run), a
    fraction as a 6-place decimal (never '7/2': a verifier reads 2); at most 64 characters in, 12 digits a
    number, 40 out. Else an error message with no digit (none to read as an answer), never raised."""
    expr = expr.strip()
    if len(expr) > 64 or not set(expr) <= _EXPR_CHARS or re.search("[0-9]{13}", expr):
        return "error: write a short expression of digits, + - * / ( ) and spaces"
    value = _evaluate(expr)
    if value is None:
        return "error: not an arithmetic expression, or a division by zero"
    if value.denominator > 1:                   # exact: round() of a Fraction is an int
        whole, part = divmod(round(abs(value) * 10**6), 10**6)
        value = f"{'-' * (value < 0)}{whole}.{part:06d}".rstrip("0")
    return str(value) if len(str(value)) <= 40 else "error: the result is too long"


def countdown_problem(rng):
    """3 or 4 numbers in 1..99 and a target in 1..999 built by folding them, in a random order, with
    random ops whose intermediate results stay positive integers; retried until in range."""
    while True:
        nums = rng.integers(1, 100, size=rng.integers(3, 5)).tolist()
        expr, *rest = map(str, rng.permutation(nums))          # folded in this order
        for x in rest:
            op, flip = "+-*/"[rng.integers(4)], rng.integers(2)
            expr = f"({x} {op} {expr})" if flip else f"({expr} {op} {x})"
            value = _evaluate(expr)                             # the game's evaluator: an exact Fraction
            if value <= 0 or value.denominator > 1:
                break                           # not a positive integer: draw a new problem
        else:
            if value <= 999:                    # >= 1: a positive integer
                prompt = (f"Using the numbers {nums}, create an equation that equals {value}. Use + - * / "
                          "and parentheses, each number exactly once. Think inside <think> </think>, "
                          "then give only the equation inside <answer> </answer>, e.g. "
                          "<answer>(1 + 2) / 3</answer>.")
                return {"prompt": prompt, "answer": {"numbers": nums, "target": int(value)},
                        "solution": expr[1:-1]}


def _last_number(text):
    found = _NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


def gsm8k_reward(prompt, completion, answer):
    """1.0 iff the last number of the last <answer> (of the whole completion if none: a signal for a model
    ignoring the format) equals the reference: '$1,234.50' == '1234.5'; '5.' is 5; '-5' negative."""
    text = extract_answer(completion)
    got, ref = _last_number(completion if text is None else text), _last_number(answer)
    return float(got is not None and got == ref)


def prefix_reward(prompt, completion, answer):
    """1.0 iff the completion starts with the answer: all or nothing, however many tokens it takes."""
    return float(completion.startswith(answer))


def overlong_penalty(n_tokens, max_new_tokens, cache):
    """DAPO's soft overlong penalty: 0 up to max_new_tokens - cache, then linear to -1 at max_new_tokens."""
    return max(-1.0, min(0.0, (max_new_tokens - cache - n_tokens) / cache)) if cache > 0 else 0.0


def held_out(text):
    """The held-out tenth, by sha256: stable across processes and machines, unlike a str's salted hash()."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % 10 == 0


GSM8K_PROMPT = ("{question}\nSolve it step by step inside <think> </think>, then give only the final "
                "number inside <answer> </answer>.")
GSM8K_FIX = "each line needs \"question\" and \"answer\" (GSM8K format, answer ending in '#### <number>')"


def load_gsm8k(path, split):
    """[{"prompt", "answer": "42"}] of openai/gsm8k's split (path "": the hub) or a local JSONL's (test: rows
    held_out(question)). Blank lines skipped; a malformed row raises ValueError with its number."""
    if split not in ("train", "test"):
        raise ValueError(f"GSM8K split {split!r}: use 'train' or 'test'")
    if not path:
        try:
            import datasets
            rows, where = datasets.load_dataset("openai/gsm8k", "main", split=split), "openai/gsm8k row"
        except Exception as e:
            raise ValueError(f"openai/gsm8k: the Hugging Face hub is unreachable or `datasets` is missing "
                             f"({type(e).__name__}): pass --data PATH.jsonl ({GSM8K_FIX})") from e
    elif not os.path.isfile(path):
        raise ValueError(f"--data {path}: no such file; pass a JSONL file ({GSM8K_FIX})")
    else:
        with open(path) as f:
            rows, where = list(f), f"{path} line"
    out = []
    for i, row in enumerate(rows, 1):
        if path and not row.strip():
            continue                            # a blank JSONL line
        try:
            row = json.loads(row) if path else row
        except json.JSONDecodeError:
            row = None
        ok = (isinstance(row, dict) and isinstance(row.get("question"), str)
              and isinstance(row.get("answer"), str) and "####" in row["answer"])
        solution, _, ref = row["answer"].rpartition("####") if ok else ("", "", "")
        if _last_number(ref) is None:
            raise ValueError(f"{where} {i}: {GSM8K_FIX}")
        if not path or held_out(row["question"]) == (split == "test"):
            out.append({"prompt": GSM8K_PROMPT.format(question=row["question"]), "answer": ref.strip(),
                        "solution": solution.strip()})
    return out


# ---- LLM tasks: a problem is {"prompt": str, "answer": ...}; reward = weighted sum of the fns above ----

def take_turns(episodes, texts):
    """The episodes whose turn ended at one decoding step, their environments stepped together with those
    turns' texts (concurrently: a slow one holds up this step only) -> each one's next user message, or
    None: the episode is over (ended, failed, or its max_turns taken). Rewards add up in episode.reward."""
    going = [(e, text) for e, text in zip(episodes, texts) if not e.failed]    # failed: never stepped again
    for (e, _), out in zip(going, concurrently([(e.env.step, text) for e, text in going])):
        if isinstance(out, EnvFailed):
            e.failed, out = out, (None, None)
        e.message, reward = out
        if reward is not None:
            e.reward = (e.reward or 0.0) + reward
        e.turns += 1
    return [None if e.failed or e.turns > e.max_turns else e.message for e in episodes]


class LLMTask:
    """Policy protocol (HFPolicy implements it): encode(text) -> ids; decode(ids) -> text without special
    tokens; eos, its end-of-turn ids; act(prompt_ids, G, greedy, env, episodes) -> G samples per prompt,
    prompt-major, each (completion ids [C] with the stop token if it stopped, sampler log-probs [C], sampled
    [C] bool, truncated) in CPU tensors. env: None, or this task: after tool_stop the sampler inserts
    reply()'s ids; when rows end a turn (an end-of-turn token, or max_turn_tokens), take_turns() steps their
    episodes' environments together and the sampler inserts the user turns they answer (sampled False,
    log-prob 0: never trained). Procedural tasks define problem(rng), held out iff held_out(its prompt):
    training draws skip that tenth. rewards[0]: correctness (0/1), what eval_acc and pass@k read; a task with
    no rewards is scored by its environment: the sum of its steps' rewards (in [0, 1], 1: solved)."""
    is_llm, metric = True, "eval_acc"
    rewards = []                                # [(weight, fn(prompt, completion, answer) -> float)]
    reads_inserted = False                      # True: the verifiers read the replies and turns inserted too
    train_set = None                            # data-backed tasks: every training problem
    hint = None                                 # --teacher self: what privileged() adds (str.format)
    system = None                               # the chat template's system prompt, if the task wants one

    # tools (--max-tool-calls): a call is an expression and "=", like 12*34=; its reply, <result>408</result>,
    # is inserted after it. "=", not tags: SmolLM2-135M wrote no <calc>12*34</calc> in 64 samples, with 4
    # prompts explaining it; it writes "34 * 18 =" unasked. tool: any plain function str -> str (`tool = f`).
    tool, tool_stop = calculator, "="
    tool_hint = " (A calculator: write an expression and =, like 12*34=, and it writes the value.)"

    def __init__(self, eval_episodes=16, data="", overlong_cache=0, max_new_tokens=256, pass_k=1,
                 max_tool_calls=0, max_turns=1, max_turn_tokens=0):
        self.eval_episodes, self.data, self.overlong_cache = eval_episodes, data, overlong_cache
        self.pass_k, self.max_tool_calls, self.max_turns = pass_k, max_tool_calls, max_turns
        self.max_turn_tokens = max_turn_tokens or max_new_tokens            # the samplers' cap on a turn
        self.tool = type(self).tool                         # off the class: `tool = f` is not bound to self
        if max_tool_calls:                                  # a wrong signature would turn every reply into an
            try:                                            # error (reward 0, training on): fail here instead
                inspect.signature(self.tool).bind("12*34")
            except TypeError:
                raise ValueError(f"{type(self).__name__}.tool{inspect.signature(self.tool)} cannot be called "
                                 f"as tool(text) -> str: make it a plain function of one argument") from None
        else:                                               # no calls: the sampler looks for none
            self.tool_stop = None
        self.max_len = max_new_tokens                       # also Dr. GRPO's constant denominator
        # a completion's total reward: every reward fn is in [0, 1]; the overlong penalty in [-1, 0]
        self.reward_range = -float(overlong_cache > 0), float(sum(w for w, _ in self.rewards) or 1)
        self.eval_set = self.eval_problems()
        n_eval = len(self.eval_set)
        if n_eval < max(eval_episodes, 10):
            print(f"warning: only {n_eval} held-out problems (--eval-episodes {eval_episodes}), "
                  f"so eval_acc moves in steps of {1 / max(n_eval, 1):.0%} and means little"
                  + (": use a larger --data (a tenth of it is held out)" if data else ""), file=sys.stderr)

    def sample(self, n, rng):
        draws = (self.problem(rng) for _ in itertools.count())          # lazily: the same draws as a loop
        return list(itertools.islice((p for p in draws if not held_out(p["prompt"])), n))

    def eval_problems(self):
        """The first eval_episodes distinct held-out draws of one fixed seed (MaxDigit's 100 draws held 69
        distinct prompts); bounded tries, as a small problem space may hold fewer."""
        rng, out = np.random.default_rng(EVAL_SEED0), {}
        for _ in range(1000 * self.eval_episodes):
            if len(out) == self.eval_episodes:
                break
            p = self.problem(rng)
            if held_out(p["prompt"]):
                out.setdefault(p["prompt"], p)
        return list(out.values())

    def max_prompt_len(self, encode):
        """The longest prompt in tokens of encode (vLLM's max_model_len): exact if data-backed, else the eval
        set's and 2,000 draws' + 10% + 8 (Countdown, SmolLM2: 111 at most in 32,000 draws)."""
        exact = self.train_set is not None
        drawn = self.train_set if exact else self.sample(2000, np.random.default_rng(EVAL_SEED0 + 1))
        longest = max(map(len, self.prompt_ids(encode, self.eval_set + drawn)))
        return longest if exact else int(longest * 1.1) + 8

    def prompt_ids(self, encode, problems):
        """Prompt ids, + tool_hint with tools (held_out() reads the prompt alone: the same eval set)."""
        return [encode(p["prompt"] + (self.tool_hint if self.max_tool_calls else ""), self.system)
                for p in problems]

    def privileged(self, problem):
        """The prompt --teacher self sees: the student's with what it must find alone (an answer, a solution)
        where this task puts it; None: there is nothing to show. Sampling and evaluation never see it."""
        return None if self.hint is None else problem["prompt"] + self.hint.format(**problem)

    def reply(self, text):
        """The text so far, ending in tool_stop -> the reply to insert, or None: no call (no digit before the
        "=") or max_tool_calls replies already. The call: the run of calculator characters before the "="; a
        tool that raises replies its error's name (no digits), for the model to learn from."""
        head = text.rpartition(self.tool_stop)[0]
        expr = head[len(head.rstrip("0123456789+*/() -")):]      # linear; a regex's [..]*$ was quadratic
        if not re.search("[0-9]", expr) or text.count("<result>") >= self.max_tool_calls:
            return None
        try:
            return f"<result>{self.tool(expr)}</result>"
        except Exception as e:
            return f"<result>error: {type(e).__name__}</result>"

    def environment(self, problem):
        """A new environment for one episode of problem, or None: the task has none (one turn). It keeps its
        own state: reset(problem) starts the episode (the model sees the problem's prompt first); step(the
        text of the model's last turn) -> (the next user message, None: the episode is over; the step's
        reward, None: none); close(), if it has one, ends it. EnvFailed from either: it cannot go on."""

    take_turns = staticmethod(take_turns)       # the samplers step the episodes through the task they get

    def graded(self, decode, ids, sampled):
        """The text the verifiers read: the model's own runs of ids, each decoded, a line each (inserted spans
        cut: '50', a turn, '75' is not 5075), or all of it if reads_inserted. ids [C], sampled [C] bool."""
        if self.reads_inserted:
            return decode(ids.tolist())
        return "\n".join(decode(run) for own, run in runs(ids, sampled) if own)

    def score(self, problem, completion, n_tokens, episode=None):
        """The reward: the verifiers' on the completion, or with no rewards the episode's environment's (0 if
        it gave none or failed); plus DAPO's overlong penalty for n_tokens."""
        if self.rewards:
            r = sum(w * fn(problem["prompt"], completion, problem["answer"]) for w, fn in self.rewards)
        else:
            r = 0.0 if episode.failed else episode.reward or 0.0
        return r + overlong_penalty(n_tokens, self.max_len, self.overlong_cache)

    def rollout(self, policy, prompts, group_size, greedy=False):
        ids, episodes = play(self, policy, prompts, group_size, greedy)
        rows = []
        for i, ((c, lp, sampled, truncated), reward, _) in enumerate(episodes):
            P = ids[i // group_size]
            tokens = torch.cat([torch.tensor(P), c])                                # [T] = [P + C]
            rewards = torch.zeros(len(tokens))                                      # [T]
            rewards[-1] = reward                                                    # on the last token
            rows.append(Trajectory(states=tokens, actions=tokens, rewards=rewards, truncated=truncated,
                                   logp=torch.cat([torch.zeros(len(P)), lp]),               # [T]
                                   mask=torch.cat([torch.zeros(len(P)), sampled.float()])))  # [T]
        return Batch.from_rows(rows, group_size)

    def _solved(self, policy, problems, k, greedy):
        """How many problems have one of k samples correct; a samples.jsonl record each."""
        records = []
        for i, ((c, _, sampled, _), reward, correct) in enumerate(play(self, policy, problems, k, greedy)[1]):
            records.append(sample_record(policy, problems[i // k]["prompt"], c, sampled, kind="eval",
                                         reward=reward, correct=correct))
        return len({i // k for i, r in enumerate(records) if r["correct"]}), records    # i // k: its problem

    def evaluate(self, policy, rank=0, world=1):
        """Greedy accuracy on the held-out problems, each rank scoring its share (hits summed: 8 ranks
        evaluate once, not 8 times); pass_at_k: one of pass_k samples right; samples: this rank's records."""
        mine, n = self.eval_set[rank::world], len(self.eval_set)
        hits, samples = self._solved(policy, mine, 1, True)
        out = {"eval_acc": all_sum(hits) / n, "samples": samples}
        if self.pass_k > 1:
            out["pass_at_k"] = all_sum(self._solved(policy, mine, self.pass_k, False)[0]) / n
        return out


def play(task, policy, problems, k, greedy=False):
    """k episodes of each problem, prompt-major -> the prompts' ids and per episode: (completion ids [C],
    sampler log-probs [C], sampled [C], truncated), its reward, and correct: rewards[0] is 1, or the
    environment's reward. The environments, if any, are reset before and closed after, all at once."""
    ids = task.prompt_ids(policy.encode, problems)
    episodes = [SimpleNamespace(env=task.environment(p), problem=p, max_turns=task.max_turns, turns=1,
                                reward=None, failed=None) for p in problems for _ in range(k)]
    envs = [e for e in episodes if e.env is not None]
    for e, out in zip(envs, concurrently([(e.env.reset, e.problem) for e in envs])):
        e.failed = out if isinstance(out, EnvFailed) else None      # failed: lost before its first turn
    # the sampler gets this task if it answers tool calls or turns
    samples = policy.act(ids, k, greedy, task if task.max_tool_calls or envs else None, envs or None)
    concurrently([(e.env.close,) for e in envs if hasattr(e.env, "close")])
    failed = [e.failed for e in envs if e.failed]
    if failed:
        print(f"warning: {len(failed)} of {len(envs)} episodes failed ({failed[0]}): ended truncated, "
              f"reward 0", file=sys.stderr)
    out = []
    for (c, lp, sampled, truncated), e in zip(samples, episodes):
        text, p = task.graded(policy.decode, c, sampled), e.problem
        if task.rewards:
            correct = task.rewards[0][1](p["prompt"], text, p["answer"]) == 1.0
        else:
            correct = e.reward == 1.0 and not e.failed
        out.append(((c, lp, sampled, truncated or bool(e.failed)), task.score(p, text, len(c), e), correct))
    return ids, out


def runs(ids, sampled):
    """[C] ids, [C] bool -> [(sampled, ids)]: the completion's runs, the model's own and the inserted ones."""
    pairs = itertools.groupby(zip(ids.tolist(), sampled.tolist()), key=lambda pair: pair[1])
    return [(own, [token for token, _ in run]) for own, run in pairs]


def sample_record(policy, prompt, ids, sampled, **fields):
    """A completion as <out>.samples.jsonl shows it: the text of the very ids trained (ids [C]), each tool
    reply's text and, if the environment answered, the episode's role-tagged turns from the prompt on (a run
    inserted after an end-of-turn id, or starting with one (a turn cut at --max-turn-tokens), is the user's,
    with the template's role names; the rest, tool replies included, the assistant's)."""
    turns, replies, turn_ended = [[]], [], False  # turns: each one's ids, the assistant's first, alternating
    for own, run in runs(ids, sampled):
        if not own and (turn_ended or run[0] in policy.eos):   # the environment's next user turn
            turns += [run, []]
        else:
            turns[-1] += run
            if not own:
                replies.append(policy.decode(run))
        turn_ended = run[-1] in policy.eos
    record = {"prompt": prompt, "completion": policy.decode(ids.tolist()), **fields}
    if replies:
        record["tool_replies"] = replies
    if len(turns) > 1:
        record["turns"] = [{"role": "user", "text": prompt}] + [
            {"role": ("assistant", "user")[i % 2], "text": policy.decode(ids)} for i, ids in enumerate(turns)]
    return record


class EnvFailed(Exception):
    """An environment could not go on with its episode (a server's error, timeout or garbage): the episode
    ends truncated with reward 0, counted in a warning. Any other exception is a bug: it stops the run."""


ENV_THREADS = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="nanorl-env")


def concurrently(calls):
    """[(fn, *args)] -> their results, called at once on ENV_THREADS: each one's wait (a server's reply)
    overlaps the others'. An EnvFailed raised is returned, as that call's result."""
    def call(fn, *args):
        try:
            return fn(*args)
        except EnvFailed as e:
            return e
    return list(ENV_THREADS.map(lambda c: call(*c), calls))


class Countdown(LLMTask):
    """Reach the target with + - * / and each given number once (TinyZero's Countdown game)."""
    rewards = [(1.0, countdown_reward), (0.1, format_reward)]
    hint = " (One solution: <answer>{solution}</answer>)"

    problem = staticmethod(countdown_problem)


class GSM8K(LLMTask):
    """Grade-school math word problems; the reference is the number after '####'."""
    rewards = [(1.0, gsm8k_reward), (0.1, format_reward)]
    hint = "\n(A worked solution: {solution} The answer: {answer}.)"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.train_set = load_gsm8k(self.data, "train")

    def sample(self, n, rng):
        return [self.train_set[i] for i in rng.integers(len(self.train_set), size=n)]

    def eval_problems(self):
        return load_gsm8k(self.data, "test")[:self.eval_episodes]


class MaxDigit(LLMTask):
    """Prompt '381=', answer '8': the largest of 3 random digits, as the completion's first character. A tiny
    character-level model learns it by RL from random init on a CPU (1,000 prompts, 107 held out). Baseline:
    always answering '9' scores 27% on the first 100 held-out prompts (27.1% on all: 1 - 0.9**3)."""
    rewards = [(1.0, prefix_reward)]

    def problem(self, rng):
        d = rng.integers(10, size=3).tolist()
        return {"prompt": "".join(map(str, d)) + "=", "answer": self.answer(d)}

    def answer(self, digits):
        return str(max(digits))


class MaxMin(MaxDigit):
    """'381=' -> '81': the largest digit, then the smallest; two tokens, rewarded all or nothing, so a reward
    says once per completion what a teacher says at each token (rung 2, distilled)."""

    def answer(self, digits):
        return f"{max(digits)}{min(digits)}"


class Addition(LLMTask):
    """'What is 47 + 85?' (8,100 prompts), correct iff the last number is the sum (GSM8K's verifier, no tags).
    SmolLM2-135M-Instruct explains at length, runs out of tokens: starts low, above 0."""
    rewards, op, hint = [(1.0, gsm8k_reward)], "+", " (The answer is {answer}.)"

    def problem(self, rng):
        a, b = rng.integers(10, 100, size=2).tolist()
        return {"prompt": f"What is {a} {self.op} {b}? Answer with the number only.",
                "answer": str(a * b if self.op == "*" else a + b)}


class Multiply(Addition):
    """'What is 37 * 48?': the product of two 2-digit numbers, which SmolLM2-135M-Instruct cannot work out
    in its head; the calculator (--max-tool-calls) can: its verifier reads the calculator's replies too."""
    op, reads_inserted = "*", True


class Guess(LLMTask):
    """A game of turns (--max-turns 3): guess a number in lo..lo+9; after a wrong guess the environment tells
    its last digit, which with the range names it. GuessBlind, the control, says only wrong: what Guess gains
    over it, the model learned from the environment's answers. (Higher/lower was tried first: SmolLM2 learned
    to count up from lo, where "higher" tells nothing, in 10 steps; the control would learn the same.) Scored
    by the game (no rewards): 1 iff a turn's guess was the secret. A game is dealt from a seed, as the OpenEnv
    server tests/openenv_guess.py deals it."""
    informative = True

    def problem(self, rng):
        seed = int(rng.integers(2**31))
        deal = np.random.default_rng(seed)
        lo = int(deal.integers(1, 491))                     # 490 ranges: 46 of them held out
        return {"prompt": f"Guess my number. It is from {lo} to {lo + 9}. Write only your guess, a single "
                          f"number.", "answer": str(deal.integers(lo, lo + 10)), "seed": seed}

    def environment(self, problem):
        return GuessGame(self.informative)


class GuessBlind(Guess):
    informative = False


class AdditionControl(Addition):
    """--teacher self's control: its teacher is shown another problem's answer (same format, wrong content).
    What the self-taught run gains over this one, it learned from the answer, not from the extra term."""

    def privileged(self, problem):
        other = self.problem(np.random.default_rng(list(problem["prompt"].encode())))
        return super().privileged(problem | {"answer": other["answer"]})


class GuessGame:
    """One game of Guess: a turn's guess is the last number in it; a wrong one is answered, with the secret's
    last digit if informative; the right one ends the game, reward 1."""

    def __init__(self, informative):
        self.informative = informative

    def reset(self, problem):
        self.secret = int(problem["answer"])

    def step(self, text):
        if _last_number(text) == self.secret:
            return None, 1.0
        hint = f": my number ends in {self.secret % 10}" if self.informative else ""
        return f"Wrong{hint}. Guess again.", 0.0


class OpenEnv(LLMTask):
    """An OpenEnv environment server (--data URL) trained unmodified, through openenv-core's own client (pip
    install -r requirements-openenv.txt): a session per sampled episode, its observations the user turns, its
    rewards the score. A problem is a seed: reset(seed) on a drawing session gives its prompt, and each of
    its episodes resets a session of its own with that seed, which must deal the same. A server whose
    observation has one text field and whose action is {"message": text} needs no code; for others,
    subclass, override observe() and action(), and add the class to TASKS."""
    timeout = 30.0                              # seconds for a server's reply; past it, the episode fails
    drawing = None                              # the session that deals the problems, opened at the first

    def problem(self, rng):
        seed = int(rng.integers(2**31))
        self.drawing = self.drawing or OpenEnvSession(self)
        try:
            return {"prompt": self.drawing.reset({"seed": seed}), "seed": seed, "answer": ""}
        except EnvFailed as e:                  # TimeoutError: train.py saves the steps trained, then stops
            raise TimeoutError(f"no problem drawn: {e}: is an OpenEnv server at --data URL?") from None

    def environment(self, problem):
        return OpenEnvSession(self)

    def observe(self, observation):
        """The server's observation (a dict) as the next user turn's text: its one text field."""
        texts = [v for v in observation.values() if isinstance(v, str)]
        if len(texts) != 1:
            raise ValueError(f"the observation has {len(texts)} text fields ({', '.join(observation)}): "
                             f"override OpenEnv.observe(observation) -> text")
        return texts[0]

    def action(self, text):
        """The model's turn as the server's action."""
        return {"message": text}


class OpenEnvSession:
    """One session of task's OpenEnv server: the environment protocol over openenv-core's client (its sync
    wrapper: an event loop on a thread). Any failure (refused, an error answer, garbage, no answer within
    task.timeout) is an EnvFailed naming the server."""

    def __init__(self, task):
        from openenv.core import GenericEnvClient       # here: the core never needs its web stack
        self.task, self.failed = task, False
        self.client = GenericEnvClient(task.data, connect_timeout_s=task.timeout,
                                       message_timeout_s=task.timeout).sync()

    def answer(self, request, *args, **kwargs):
        """request's result as (its observation's text, None if done; its reward, a number or None), or
        EnvFailed (the client checks no answer: a reward "lots" comes back as it is)"""
        try:
            result = request(*args, **kwargs)
            reward = None if result.reward is None else float(result.reward)
            return None if result.done else self.task.observe(result.observation), reward
        except Exception as e:
            self.failed = True
            raise EnvFailed(f"{self.task.data}: {type(e).__name__}: {e!s:.200}") from None

    def reset(self, problem):
        text, _ = self.answer(self.client.reset, seed=problem["seed"])
        if problem.get("prompt", text) != text:
            raise EnvFailed(f"{self.task.data}: reset(seed={problem['seed']}) dealt another observation than "
                            "at the draw: the server must deal the same one for a seed")
        return text

    def step(self, text):
        return self.answer(self.client.step, self.task.action(text))

    def close(self):
        """Ends the session; one that failed, on a thread not waited for: a frozen server holds a close for
        websockets' own 10 s, whatever task.timeout says."""
        if self.failed:
            threading.Thread(target=self.client.close, daemon=True).start()
        else:
            self.client.close()


# --task's names, the one registry of tasks: a new task is its class here
TASKS = {"cartpole": CartPole, "countdown": Countdown, "gsm8k": GSM8K, "maxdigit": MaxDigit,
         "maxmin": MaxMin, "addition": Addition, "addition_control": AdditionControl, "multiply": Multiply,
         "guess": Guess, "guess_blind": GuessBlind, "openenv": OpenEnv}
