"""Watching a run (issue 16): <out>.samples.jsonl holds the completions that were scored, as text; the CSV keeps
one row per step across resumes (--report-to's trackers went in issue 32: Logger.log says where to add one)."""
import csv
import json
import os
import types
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers", reason="the LLM path needs: pip install -r requirements-llm.txt")
import train  # noqa: E402
from core import Batch, Trajectory  # noqa: E402
from model import make_tiny_lm  # noqa: E402
from tasks import prefix_reward, sample_record  # noqa: E402



def test_samples_are_the_scored_ids_as_text_with_rewards_and_advantages(tmp_path, monkeypatch, capsys):
    tiny = make_tiny_lm(str(tmp_path / "tiny"))
    batches = {}                                        # step -> the batch the loop trained on (a spy)
    make_task = train.make_task

    def spying(cfg):
        task = make_task(cfg)
        rollout = task.rollout

        def recorded(*args, **kwargs):
            batch = rollout(*args, **kwargs)
            batches[len(batches) + 1] = batch
            return batch
        task.rollout = recorded
        return task
    monkeypatch.setattr(train, "make_task", spying)
    cfg = train.Config(task="maxdigit", model=tiny, algo="grpo", n_prompts=4, group_size=4, max_new_tokens=2,
                       steps=4, eval_every=2, eval_episodes=20, solve_at=0, lr=0.01, out=str(tmp_path / "run"))
    train.train(cfg)
    out = capsys.readouterr().out
    records = [json.loads(line) for line in open(tmp_path / "run.samples.jsonl")]
    # per evaluation (steps 0, 2, 4): the first 8 held-out problems; steps 2 and 4: a group of 4 too
    assert [(r["step"], r["kind"]) for r in records] == [
        (s, kind) for s in (0, 2, 4) for kind in ["eval"] * 8 + ["train"] * 4 * (s > 0)]
    held_out = {r["prompt"] for r in records if r["kind"] == "eval" and r["step"] == 0}
    assert len(held_out) == 8
    for r in records:
        assert set(r) == {"step", "kind", "prompt", "completion", "reward",
                          "correct" if r["kind"] == "eval" else "advantage"}
        answer = str(max(r["prompt"][-4:-1]))           # MaxDigit: '381=' -> '8'
        assert r["reward"] == prefix_reward(r["prompt"], r["completion"], answer)
        if r["kind"] == "eval":
            assert r["prompt"] in held_out and r["correct"] == (r["reward"] == 1.0)
    for step in (2, 4):                                 # the first group whose rewards differ: the ids scored
        batch, group = batches[step], [r for r in records if r["step"] == step and r["kind"] == "train"]
        R4 = batch.rewards.sum(1).view(4, 4)                                        # [n_prompts, G]
        g = next((g for g in range(4) if len(set(R4[g].tolist())) > 1), 0)
        R = R4[g]                                                                   # [G]
        adv = (R - R.mean()) / (R.std() + 1e-6) if R.std() > 0 else torch.zeros(4)  # GRPO, worked out here
        for i, r in zip(range(4 * g, 4 * g + 4), group):
            ids = batch.states[i][batch.mask[i] > 0].tolist()                       # no tool: all sampled
            assert r["completion"] == "".join(VOCAB[t] for t in ids)
            assert r["prompt"] == "".join(VOCAB[t] for t in batch.states[i][:len(r["prompt"])].tolist())
            assert r["reward"] == R[i - 4 * g].item()
            assert r["advantage"] == pytest.approx(adv[i - 4 * g].item(), abs=1e-6)
    # under each evaluation's step line: its first right and first wrong held-out completion, if any
    for step in (0, 2, 4):
        evals = [r for r in records if r["step"] == step and r["kind"] == "eval"]
        for right in (True, False):
            shown = [r for r in evals if r["correct"] == right][:1]
            line = [f"  {'right' if right else 'wrong'}: {r['prompt']!r} -> {r['completion']!r}" for r in shown]
            assert all(x in out.splitlines() for x in line), (line, out[-2000:])
    assert "  wrong: " in out                          # a random tiny LM is wrong somewhere at step 0


def test_the_training_group_shown_is_one_whose_rewards_differ():
    """4 groups of 2, rewards [1, 1], [0, 1], [1, 0], [0, 0]: the second is shown (the first compares nothing,
    advantage 0 all through: what step 5 of a SmolLM2 run showed, 8 identical answers); none differing, the
    first. Token i decodes as chr(ord('a') + i); rows are 'p' then their own letter."""
    decode = lambda ids: "".join(chr(ord("a") + i) for i in ids)
    rows = [Trajectory(states=torch.tensor([15, i]), actions=torch.tensor([15, i]), logp=torch.zeros(2),
                       rewards=torch.tensor([0.0, r]), mask=torch.tensor([0.0, 1])) for i, r in enumerate(
                           [1.0, 1, 0, 1, 1, 0, 0, 0])]
    batch, policy = Batch.from_rows(rows, 2), types.SimpleNamespace(decode=decode, eos=[99])
    adv = torch.arange(8.0)[:, None] * batch.mask                     # any [N, T]: read at the completion
    shown = list(train.group_samples(policy, batch, adv))
    assert [(r["prompt"], r["completion"], r["reward"], r["advantage"]) for r in shown] == [
        ("p", "c", 0.0, 2.0), ("p", "d", 1.0, 3.0)]
    same = Batch.from_rows(rows[:2] + rows[6:], 2)                    # [1, 1], [0, 0]: the first
    assert [r["completion"] for r in train.group_samples(policy, same, adv[:4])] == ["a", "b"]
    # a teacher's advantage differs per token: a row shows its mean over the completion, not its first token's
    two = Batch.from_rows([Trajectory(states=torch.tensor([15, i, i]), actions=torch.tensor([15, i, i]),
                                      logp=torch.zeros(3), rewards=torch.tensor([0.0, 0, r]),
                                      mask=torch.tensor([0.0, 1, 1])) for i, r in [(2, 1.0), (3, 0.0)]], 2)
    adv = torch.tensor([[0.0, 1, 3], [0, -2, 0]])
    assert [r["advantage"] for r in train.group_samples(policy, two, adv)] == [2.0, -1.0]


VOCAB = ["", "", ""] + list("0123456789 =,")          # make_tiny_lm's ids: 3 specials (decoded as ''), then chars


def test_a_tool_reply_and_a_user_turn_are_marked_in_their_sample():
    """The tiny LM's tokenizer, with ',' as its end-of-turn id: an inserted run after a call is a tool reply, one
    after an end of turn, or starting with an end id (a turn cut at --max-turn-tokens: the template's end id
    comes first), is the user's turn; the episode's turns, from the prompt (the user's) on, alternate, the
    replies inside the assistant's."""
    decode = lambda ids: "".join(VOCAB[i] for i in ids)
    policy = SimpleNamespace(decode=decode, eos=[1, VOCAB.index(",")])
    ids = torch.tensor([VOCAB.index(c) for c in "12=144 9=81 1"])
    sampled = torch.tensor([c == "s" for c in "sssrrrsssrrss"])                      # r: a reply's ids
    record = sample_record(policy, "p", ids, sampled, kind="eval")
    assert record == {"prompt": "p", "completion": "12=144 9=81 1", "kind": "eval", "tool_replies": ["144", "81"]}
    assert sample_record(policy, "p", ids, torch.ones(13, dtype=torch.bool)) == {      # no reply: no key
        "prompt": "p", "completion": "12=144 9=81 1"}
    pieces = [("5,", "s"), ("9 8", "u"), ("6=", "s"), ("36", "r"), (" 1,", "s"), ("7 ", "u"), ("4", "s")]
    ids = torch.tensor([VOCAB.index(c) for text, _ in pieces for c in text])        # u: the user's turn
    sampled = torch.tensor([kind == "s" for text, kind in pieces for _ in text])
    assert sample_record(policy, "p", ids, sampled) == {
        "prompt": "p", "completion": "5,9 86=36 1,7 4", "tool_replies": ["36"],
        "turns": [{"role": "user", "text": "p"}, {"role": "assistant", "text": "5,"},
                  {"role": "user", "text": "9 8"}, {"role": "assistant", "text": "6=36 1,"},
                  {"role": "user", "text": "7 "}, {"role": "assistant", "text": "4"}]}
    # a capped turn '5 5', then <|endoftext|> (id 1, decoded '') and the user's '9 8' inserted, then '4'
    ids = torch.tensor([VOCAB.index(c) for c in "5 5"] + [1] + [VOCAB.index(c) for c in "9 84"])
    sampled = torch.tensor([True] * 3 + [False] * 4 + [True])
    assert sample_record(policy, "p", ids, sampled)["turns"] == [
        {"role": "user", "text": "p"}, {"role": "assistant", "text": "5 5"}, {"role": "user", "text": "9 8"},
        {"role": "assistant", "text": "4"}]


# ---- trackers: every CSV row, read back from each library's own files ----

def test_a_resume_from_an_older_checkpoint_keeps_one_csv_row_per_step(tmp_path):
    """A run trained on to step 4, then "killed" back to its step-2 checkpoint: steps 3 and 4 are trained again
    and logged once each (open_csv drops the lost try's rows), whatever the resumes."""
    kw = dict(out=str(tmp_path / "r"), solve_at=0.0, n_prompts=4)
    train.train(train.Config(steps=2, **kw))
    os.replace(tmp_path / "r.pt", tmp_path / "r-step2.pt")
    for steps in (4, 5):
        train.train(train.Config(steps=steps, resume=str(tmp_path / "r-step2.pt"), **kw))
    steps = [int(row["step"]) for row in csv.DictReader(open(tmp_path / "r.csv"))]
    assert steps == [0, 1, 2, 3, 4, 5]
