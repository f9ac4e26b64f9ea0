"""LLM task side: hand-worked verifier cases, hostile inputs, data loading and splits, rollout bookkeeping."""
import json
import sys

import numpy as np
import pytest
import torch

from tasks import (GSM8K, TASKS, Countdown, MaxDigit, MaxMin, countdown_problem, countdown_reward, extract_answer,
                   format_reward, gsm8k_reward, held_out, load_gsm8k, prefix_reward, overlong_penalty)


def cd(expr, numbers, target):
    return countdown_reward("", f"<think>hm</think><answer>{expr}</answer>", {"numbers": numbers, "target": target})


# ---- Countdown verifier ----

@pytest.mark.parametrize("expr, numbers, target", [
    ("(2 + 3) * 5", [2, 3, 5], 25),            # 5 * 5 = 25
    ("5*(3+2)", [5, 3, 2], 25),                 # same, no spaces, other order
    ("2 + 3 * 4", [2, 3, 4], 14),               # precedence: 2 + 12 = 14, not 5 * 4 = 20
    ("10 - 4 - 3", [10, 4, 3], 3),              # left-associative: (10 - 4) - 3 = 3, not 10 - 1 = 9
    ("6 / (3 / 4)", [3, 4, 6], 8),              # 3/4 = 0.75 exactly, 6 / 0.75 = 8
    ("(5 - 1 / 5) * 5", [1, 5, 5, 5], 24),      # 5 - 1/5 = 24/5, * 5 = 24: needs exact fractions
    ("(" * 90 + "2 + 3" + ")" * 90 + " * 5", [2, 3, 5], 25),  # deep but under MAX_EXPR: still parsed
])
def test_countdown_correct(expr, numbers, target):
    assert cd(expr, numbers, target) == 1.0


@pytest.mark.parametrize("expr, numbers, target", [
    ("(2 + 3) * 5", [2, 3, 5], 26),             # 25 != 26: wrong target
    ("(5 + 5) * 3", [2, 3, 5], 30),             # 5 reused, 2 missing
    ("2 * 5 * 5", [2, 5], 50),                  # 5 reused
    ("2 * 5", [2, 3, 5], 10),                   # 3 missing
    ("23 + 2", [2, 3, 25], 25),                 # 2 and 3 concatenated into 23
    ("2 5", [25], 25),                          # 25 split into 2 and 5
    ("-2 + 3 + 5", [2, 3, 5], 6),               # unary minus is not an operator of the game
    ("07 * 2 + 5", [7, 2, 5], 19),              # leading zeros are rejected (documented)
    ("1/0", [1, 0], 1),                         # division by zero
    ("5 / (3 - 3)", [5, 3, 3], 5),              # division by a zero intermediate
    ("(2 + 3 * 5", [2, 3, 5], 17),              # unbalanced
    ("2 + 3) * 5", [2, 3, 5], 25),
    ("()2 + 3 * 5", [2, 3, 5], 17),
    ("", [2, 3, 5], 10),
    ("__import__('os')", [2, 3, 5], 10),        # not in the character set
    ("9**9**9", [9, 9, 9], 729),                # ** is not an operator: rejected by the parser
    ("(" * 1000 + "2 + 3" + ")" * 1000 + " * 5", [2, 3, 5], 25),  # over MAX_EXPR: rejected by length
    ("(2 + \uff13) * 5", [2, 3, 5], 25),        # fullwidth 3: isdigit() is True for it, we are not
    ("(2 + \u0663) * 5", [2, 3, 5], 25),        # Arabic-Indic 3
    ("1+" * 50_000 + "1", [1] * 50_001, 50_001),  # 100k characters: bounded before any work
    ("(2 + 3) * 5.0", [2, 3, 5], 25),           # '.' is not in the character set
])
def test_countdown_rejects(expr, numbers, target):
    assert cd(expr, numbers, target) == 0.0


def test_countdown_tags():
    ans = {"numbers": [2, 3, 5], "target": 25}
    assert countdown_reward("", "(2 + 3) * 5", ans) == 0.0                        # missing tag
    assert countdown_reward("", "<answer>(2 + 3) * 5", ans) == 0.0                # unclosed tag
    assert countdown_reward("", "<answer>2+3+5</answer><answer>(2+3)*5</answer>", ans) == 1.0  # last wins
    assert countdown_reward("", "<answer>(2+3)*5</answer><answer>2+3+5</answer>", ans) == 0.0
    assert extract_answer("a <answer> x </answer> b <answer>y</answer>") == "y"
    assert extract_answer("</answer><answer>") is None


def test_countdown_generation():
    a = [countdown_problem(np.random.default_rng(7)) for _ in range(2)]
    assert a[0] == a[1]                                                               # deterministic per seed
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = countdown_problem(rng)
        nums, target = p["answer"]["numbers"], p["answer"]["target"]
        assert len(nums) in (3, 4) and all(1 <= x <= 99 for x in nums) and 1 <= target <= 999
        assert str(target) in p["prompt"] and "<answer>" in p["prompt"]
        assert countdown_reward(p["prompt"], f"<answer>{p['solution']}</answer>", p["answer"]) == 1.0


# ---- format, GSM8K, MaxDigit, overlong ----

@pytest.mark.parametrize("completion, expected", [
    ("<think>2+2</think><answer>4</answer>", 1.0),
    ("<answer>4</answer>\n  ", 1.0),            # trailing whitespace is fine
    ("<answer>4</answer> and more", 0.5),       # a pair, but text after it
    ("4", 0.0), ("<answer>4", 0.0), ("</answer>4<answer>", 0.0),
])
def test_format_reward(completion, expected):
    assert format_reward("", completion, None) == expected


@pytest.mark.parametrize("completion, ref, expected", [
    ("<answer>1,234</answer>", "1234", 1.0),    # thousands separator
    ("<answer>$18.</answer>", "18", 1.0),       # dollar sign, sentence-final '.'
    ("<answer>3.50</answer>", "3.5", 1.0),      # 3.50 == 3.5
    ("<answer>-5</answer>", "-5", 1.0),
    ("<answer>5</answer>", "-5", 0.0),
    ("<answer>After 3 days she has 42 eggs</answer>", "42", 1.0),  # last number in the tag
    ("she pays 12 + 6 = 18 dollars", "18", 1.0),                    # no tag: last number of the text
    ("<answer>17</answer> or maybe 18", "18", 0.0),                 # the tag wins over the text
    ("<answer>1, 2</answer>", "12", 0.0),       # a list is not a thousands group: last number is 2
    ("<answer>\uff11\uff18</answer>", "18", 0.0),  # fullwidth digits are not numbers here
    ("<answer>none</answer>", "18", 0.0),
])
def test_gsm8k_reward(completion, ref, expected):
    assert gsm8k_reward("", completion, ref) == expected


def test_prefix_reward_and_problems():
    assert prefix_reward("381=", "8", "8") == 1.0
    assert prefix_reward("381=", "89", "8") == 1.0      # what follows the answer is not read
    assert prefix_reward("381=", "81", "81") == 1.0 and prefix_reward("381=", "8", "81") == 0.0   # all of it
    assert prefix_reward("381=", "9", "8") == 0.0
    assert prefix_reward("381=", " 8", "8") == 0.0
    assert prefix_reward("381=", "", "8") == 0.0
    for p in MaxDigit().sample(100, np.random.default_rng(0)):
        assert set(p["prompt"]) <= set("0123456789 =,") and p["answer"] == max(p["prompt"][:3])
    for p, q in zip(MaxDigit().sample(100, np.random.default_rng(0)), MaxMin().sample(100, np.random.default_rng(0))):
        assert q["prompt"] == p["prompt"] and q["answer"] == p["answer"] + min(p["prompt"][:3])   # the same draws


def test_overlong_penalty():
    # max 10, cache 4: free up to 10 - 4 = 6 tokens, then -1/4 per token
    assert overlong_penalty(6, 10, 4) == 0.0
    assert overlong_penalty(7, 10, 4) == -0.25
    assert overlong_penalty(8, 10, 4) == -0.5
    assert overlong_penalty(10, 10, 4) == -1.0
    assert overlong_penalty(10, 10, 0) == 0.0             # cache 0: off


# ---- GSM8K data ----

def write_jsonl(path, n=60):
    rows = [{"question": f"q{i}", "answer": f"steps <<{i}*2={2 * i}>>\n#### {2 * i:,}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_gsm8k_local_round_trip_and_split(tmp_path):
    write_jsonl(tmp_path / "g.jsonl")
    train, test = (load_gsm8k(str(tmp_path / "g.jsonl"), s) for s in ("train", "test"))
    assert load_gsm8k(str(tmp_path / "g.jsonl"), "test") == test                    # deterministic
    assert len(train) + len(test) == 60 and not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert len(test) == 6 and "q9\n" in test[0]["prompt"] and test[0]["answer"] == "18"
    assert load_gsm8k(str(tmp_path / "g.jsonl"), "train")[-1]["answer"] == "118"   # "#### 118" of q59
    # pinned: sha256, not the per-process salted hash(), picks q9, q14, q24, ... out of q0..q99
    assert [i for i in range(30) if held_out(f"q{i}")] == [9, 14, 24, 25]


@pytest.mark.parametrize("bad", ["not json", '{"question": "q"}', '{"answer": "#### 3"}', "[1, 2]",
                                 '{"question": "q", "answer": "3"}', '{"question": "q", "answer": "#### many"}',
                                 '{"question": 5, "answer": "#### 3"}'])
def test_gsm8k_malformed_line(tmp_path, bad):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n\n' + bad + "\n")    # bad line is line 3
    with pytest.raises(ValueError, match=r"bad\.jsonl line 3: .*#### <number>"):
        load_gsm8k(str(path), "train")


def test_gsm8k_missing_file_and_hub(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="no such file"):
        load_gsm8k(str(tmp_path / "nope.jsonl"), "train")
    monkeypatch.setitem(sys.modules, "datasets", None)                              # import fails: offline
    with pytest.raises(ValueError, match="hub is unreachable.*--data PATH.jsonl"):
        load_gsm8k("", "train")
    with pytest.raises(ValueError, match="split"):
        load_gsm8k(str(tmp_path / "nope.jsonl"), "validation")


# ---- held-out problems never train ----

@pytest.mark.parametrize("name", [pytest.param("countdown", marks=pytest.mark.slow), "maxdigit", "gsm8k"])
def test_held_out_never_in_training(name, tmp_path):
    write_jsonl(tmp_path / "g.jsonl", 200)
    task = TASKS[name](eval_episodes=5, data=str(tmp_path / "g.jsonl"), overlong_cache=0, max_new_tokens=8, pass_k=1)
    assert task.is_llm and task.metric == "eval_acc" and len(task.eval_set) == 5
    eval_prompts = {p["prompt"] for p in task.eval_set}
    assert task.eval_problems() == task.eval_set                                    # every rank: the same set
    train = task.sample(10_000, np.random.default_rng(1))
    assert len(train) == 10_000 and not eval_prompts & {p["prompt"] for p in train}


# ---- rollout and evaluate against a scripted policy ----

class ScriptedLLM:
    """Stands in for HFPolicy: encode = character codes, decode = characters (stop id 0 skipped, as a
    special token), act = reply(prompt_text, sample_index, greedy) -> (text, truncated), with the
    stop token appended unless truncated and log-probs -0.1, -0.2, ... per completion token."""

    def __init__(self, reply):
        self.reply, self.calls, self.eos = reply, [], [0]

    def encode(self, text, system=None):
        assert system is None                                   # no task here asks for a system prompt
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i != 0)

    def act(self, prompt_ids, group_size, greedy=False, env=None, episodes=None):
        assert env is None and episodes is None                 # MaxDigit answers no call and plays no turn
        self.calls.append((len(prompt_ids), group_size, greedy))
        out = []
        for ids in prompt_ids:                                   # prompt-major: all samples of prompt 0 first
            for j in range(group_size):
                text, trunc = self.reply(self.decode(ids), j, greedy)
                c = torch.tensor(self.encode(text) + ([] if trunc else [0]))
                out.append((c, -0.1 * torch.arange(1, len(c) + 1), torch.ones(len(c), dtype=torch.bool), trunc))
        return out


def test_rollout_bookkeeping():
    task = MaxDigit(eval_episodes=2, data="", overlong_cache=2, max_new_tokens=4, pass_k=1)
    script = {("381=", 0): ("8", False), ("381=", 1): ("9", False),
              ("070=", 0): ("7777", True), ("070=", 1): ("7a", False)}
    policy = ScriptedLLM(lambda prompt, j, greedy: script[prompt, j])
    b = task.rollout(policy, [{"prompt": "381=", "answer": "8"}, {"prompt": "070=", "answer": "7"}], 2)
    # completion lengths C: '8'+stop 2, '9'+stop 2, '7777' 4 (truncated, no stop), '7a'+stop 3
    # overlong (max 4, cache 2): free up to 2 tokens; C=3 -> -0.5, C=4 -> -1
    # rewards: 1 + 0, 0 + 0, 1 - 1, 1 - 0.5
    assert policy.calls == [(2, 2, False)] and b.states.shape == (4, 8)            # T = 4 prompt + 4
    assert b.group_size == 2 and b.n_prompts == 2
    assert torch.equal(b.truncated, torch.tensor([False, False, True, False]))
    assert torch.equal(b.states, b.actions)
    assert b.states[0].tolist() == [ord(c) for c in "381=8"] + [0, 0, 0]           # stop 0, then padding 0
    assert b.states[2].tolist() == [ord(c) for c in "070=7777"]
    assert b.mask.tolist() == [[0] * 4 + [1] * C + [0] * (4 - C) for C in (2, 2, 4, 3)]
    assert torch.allclose(b.logp[3], torch.tensor([0, 0, 0, 0, -0.1, -0.2, -0.3, 0]))
    assert b.rewards.sum(1).tolist() == [1.0, 0.0, 0.0, 0.5]
    last = (b.mask.cumsum(1) == b.mask.sum(1, keepdim=True)) & (b.mask == 1)       # last completion token
    assert torch.equal(b.rewards != 0, last & (b.rewards.sum(1) != 0)[:, None])


def test_evaluate_greedy_and_pass_at_k():
    task = MaxDigit(eval_episodes=8, data="", overlong_cache=0, max_new_tokens=2, pass_k=4)
    # greedy right; sampling right only on the 4th sample -> pass@4 = 1
    policy = ScriptedLLM(lambda p, j, greedy: (max(p[:3]) if greedy or j == 3 else "x", False))
    got = task.evaluate(policy)
    # a samples.jsonl record per greedy completion: its text, full reward and correctness
    assert got.pop("samples") == [{"prompt": p["prompt"], "completion": p["answer"], "kind": "eval", "reward": 1.0,
                                   "correct": True} for p in task.eval_set]
    assert got == {"eval_acc": 1.0, "pass_at_k": 1.0}
    assert policy.calls == [(8, 1, True), (8, 4, False)]
    nines = ScriptedLLM(lambda p, j, greedy: ("9", False))                           # the 27.1% baseline
    expected = np.mean([p["answer"] == "9" for p in task.eval_set])
    got = task.evaluate(nines)
    assert [s["correct"] for s in got.pop("samples")] == [p["answer"] == "9" for p in task.eval_set]
    assert got == {"eval_acc": expected, "pass_at_k": expected}


def test_each_rank_evaluates_its_share_and_the_hits_add_up():
    """LLMTask.evaluate as rank r of 2, without a process group (all_sum is then the identity; over 2 gloo
    ranks: test_dist's, slow with the tiny LM): rank r scores eval_set[r::2], and the ranks' accuracies add
    up to one process's."""
    task = MaxDigit(eval_episodes=8, data="", overlong_cache=0, max_new_tokens=2, pass_k=1)
    policy = ScriptedLLM(lambda p, j, greedy: (max(p[:3]) if int(p[0]) % 2 else "x", False))   # odd first digit
    alone = task.evaluate(policy)
    ranks = [task.evaluate(policy, rank, 2) for rank in range(2)]
    for rank, got in enumerate(ranks):
        assert got["samples"] == alone["samples"][rank::2]
    assert 0 < alone["eval_acc"] < 1 and sum(r["eval_acc"] for r in ranks) == alone["eval_acc"]


def test_reward_weights_and_constructors():
    assert [w for w, _ in Countdown().rewards] == [1.0, 0.1] and [w for w, _ in MaxDigit().rewards] == [1.0]
    assert GSM8K.rewards[0][1] is gsm8k_reward
    task = Countdown(max_new_tokens=64)
    assert task.max_len == 64                                                        # Dr. GRPO's constant
