"""Environment turns (--max-turns): the model ends its turn, the task's environment answers as the next user
turn (inserted ids, mask 0), the model goes on. HFPolicy's batched loop on the tiny LM the project builds,
with a scripted environment; the text the verifiers read; the turns column."""
import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the LLM path needs: pip install -r requirements-llm.txt")
from core import Batch  # noqa: E402
from tasks import TASKS, Addition, Guess, GuessBlind, Multiply  # noqa: E402

from test_async import rows, start, wait, workers  # noqa: E402
from test_dist import free_port  # noqa: E402
from test_llm import as_batch, policy, tiny  # noqa: E402, F401
from test_smollm2 import smollm2  # noqa: E402, F401
from test_tools import lively  # noqa: E402


class ScriptedEnv:
    """An environment (a TEST DOUBLE, named so: tasks.LLMTask's protocol without a tool) that answers a row's
    turns with its problem's "say" until it has had problem["turns"] turns, and records what it was asked. A
    test object because the tiny random LM plays no game; the sampler it drives is the real one."""
    tool_stop = None

    def __init__(self, max_turns):
        self.max_turns, self.asked = max_turns, []

    def respond(self, problem, text):
        self.asked.append((problem["id"], text))
        turns = sum(i == problem["id"] for i, _ in self.asked)
        return problem["say"] if turns < problem["turns"] else None


def turn_policy(tiny, **kw):  # noqa: F811
    """The tiny LM, redrawn lively, whose turn ends at a '2' too (a test setting: its random weights rarely
    write <|endoftext|>, and a '2' comes every few tokens)."""
    pol = lively(policy(tiny, **kw))
    pol.eos = [1, pol.tok.convert_tokens_to_ids("2")]
    return pol


def test_rows_that_end_after_1_2_and_3_turns_are_token_in_token_out_and_score_as_sampled(tiny):  # noqa: F811
    """One batch, rows of 1, 2 and 3 turns: each row is its sampled ids with the message's own ids after each
    end of turn but the last (mask 0, log-prob 0), and a fresh forward over the whole episode gives the
    sampler's log-probs at every trained position: the KV cache stayed valid across the insertions."""
    pol = turn_policy(tiny, max_new_tokens=40)
    say = pol.tok("7 7", add_special_tokens=False)["input_ids"]
    problems = [{"id": i, "turns": i + 1, "say": "7 7"} for i in range(3)]
    prompts = [pol.encode(p) for p in ("1=", "77 0 5 4=", "3 8 1=")]
    env = ScriptedEnv(max_turns=3)
    torch.manual_seed(0)
    samples = pol.act(prompts, 1, env=env, problems=problems)
    for (c, lp, sampled, truncated), p in zip(samples, problems):
        assert not truncated, "a row ran out of budget: raise max_new_tokens"
        ids, own = c.tolist(), sampled.tolist()
        stops = [i for i, t in enumerate(ids) if t in pol.eos and own[i]]
        assert len(stops) == p["turns"] and stops[-1] == len(ids) - 1          # each turn ends; the last is the end
        for s in stops[:-1]:                                                   # then the message, inserted
            assert ids[s + 1:s + 1 + len(say)] == say and own[s + 1:s + 1 + len(say)] == [False] * len(say)
        assert sum(own) == len(ids) - len(say) * (p["turns"] - 1)              # nothing else inserted
        assert (lp[~sampled] == 0).all() and (lp[sampled] < 0).all()
    # asked after each turn but the third (--max-turns 3 ends it), with the text so far, inserted turns included
    assert sorted(i for i, _ in env.asked) == [0, 1, 1, 2, 2] and env.asked[-1][1].count("7 7") >= 1
    batch = as_batch(prompts, samples, 1)
    assert batch.turns(pol.eos).tolist() == [1, 2, 3] and batch.insertions().tolist() == [0, 1, 2]
    # fp32 rounding of the lively weights' large logits (~1e-5 without turns too); a stale cache gives O(1)
    assert (pol.logprobs(batch)[0] - batch.logp).abs().max() < 1e-4


def test_greedy_plays_the_same_turns_and_a_turn_that_does_not_fit_ends_the_episode_truncated(tiny):  # noqa: F811
    pol = turn_policy(tiny, max_new_tokens=40)
    prompts, one = [pol.encode("3 8 1=")], [{"id": 0, "turns": 2, "say": "7 7"}]   # turn 1 ends at EOS
    c, _, sampled, truncated = pol.act(prompts, 1, greedy=True, env=ScriptedEnv(2), problems=one)[0]
    first = pol.act(prompts, 1, greedy=True)[0][0].tolist()                # the first turn, alone
    head = first + pol.tok("7 7", add_special_tokens=False)["input_ids"]
    rest = pol.act([prompts[0] + head], 1, greedy=True)[0][0].tolist()     # greedy from the whole episode
    assert c.tolist() == head + rest[:40 - len(head)] and not truncated
    # a budget that ends inside the inserted turn: the episode ends at the first turn's end, truncated
    short = turn_policy(tiny, max_new_tokens=len(first) + 1)
    c, _, sampled, truncated = short.act(prompts, 1, greedy=True, env=ScriptedEnv(2), problems=one)[0]
    assert c.tolist() == first and sampled.all() and truncated


def test_turns_by_hand():
    """turns = end-of-turn ids trained + 1 if cut mid-turn; insertions = runs of 0s between 1s (eos id 9)."""
    mask = torch.tensor([[0, 1, 1, 0, 0, 0.0],     # 1 turn, ended:            [_, 5, 9]
                         [0, 1, 0, 1, 1, 1],       # 2 turns, the last cut:    [_, 9, (7), 5, 5, 5]
                         [0, 1, 0, 1, 0, 1]])      # 3 turns, ended:           [_, 9, (7), 9, (7), 9]
    states = torch.tensor([[3, 5, 9, 0, 0, 0], [3, 9, 7, 5, 5, 5], [3, 9, 7, 9, 7, 9]])
    batch = Batch(states, states, torch.zeros(3, 6), torch.zeros(3, 6), mask, torch.zeros(3, dtype=bool), None, 1)
    assert batch.turns([9]).tolist() == [1, 2, 3] and batch.insertions().tolist() == [0, 1, 2]


def chars(text):
    return [ord(c) for c in text]


def decode(ids):
    return "".join(map(chr, ids))


def graded(task, pieces):
    """(text, own) pieces -> the text task's verifiers read, through character ids (one per character)."""
    ids = torch.tensor([i for text, _ in pieces for i in chars(text)])
    sampled = torch.tensor([own for text, own in pieces for _ in text])
    return task.graded(decode, ids, sampled)


def test_the_verifiers_read_the_models_own_text_unless_the_task_reads_the_insertions():
    """A calculator's reply is not the model's answer: on Addition (answer 40) '12+28=<result>40</result>' was
    graded as a correct 40 by the last number of the whole text; now the model's own text is read (inserted
    spans cut, a line per run: '50', a turn, '75' is not 5075). Multiply says it reads the replies too."""
    add, mul = Addition(eval_episodes=2, max_tool_calls=1), Multiply(eval_episodes=2, max_tool_calls=1)
    called = [("12+28=", True), ("<result>40</result>", False)]
    problem = {"prompt": "What is 12 + 28?", "answer": "40"}
    assert graded(add, called) == "12+28=" and add.score(problem, graded(add, called), 10) == 0.0
    assert add.score(problem, graded(add, called + [(" so 40", True)]), 10) == 1.0
    assert graded(mul, called) == "12+28=<result>40</result>"
    assert mul.score(problem, graded(mul, called), 10) == 1.0
    turns = Addition(eval_episodes=2, max_turns=3)
    answers = [("50", True), ("Are you sure? Answer again.", False), ("75", True)]
    assert graded(turns, answers) == "50\n75" and turns.score({"prompt": "", "answer": "75"}, "50\n75", 4) == 1.0


def test_max_turns_needs_a_task_with_an_environment_and_turns_alone_look_for_no_call():
    """--max-turns on a task that answers no turn (no respond()) did nothing, silently: refused now. A task with
    turns and no tools gets no tool_stop, so the sampler decodes nothing to look for a call."""
    from train import Config, validate
    assert Addition(eval_episodes=2).env is None
    with pytest.raises(ValueError, match="^--max-turns 3: --task addition has no environment to answer a turn"):
        validate(Config(task="addition", model="m", algo="grpo", group_size=2, max_turns=3))
    validate(Config(task="guess", model="m", algo="grpo", group_size=2, max_turns=3))
    tools, game = Addition(eval_episodes=2, max_tool_calls=1), Guess(eval_episodes=2, max_turns=3)
    assert tools.env is tools and tools.tool_stop == "=" and tools.max_turns == 1
    assert game.env is game and game.tool_stop is None


def test_the_turn_budget_is_a_setting_trainer_and_workers_share():
    """A worker of another --max-turns is refused (serve.TrainerClient.check compares the fingerprints), and the
    trainer's gate takes --max-tool-calls + --max-turns - 1 holes a row (tests/test_serve.py sends them)."""
    from tasks import CartPole
    from train import Config, batch_limits, fingerprint
    assert fingerprint(Config(max_turns=3), 2)["max_turns"] == 3 != fingerprint(Config(), 2)["max_turns"]
    assert batch_limits(Config(max_turns=3, max_tool_calls=2), CartPole(), None, 2)["insertions"] == 4


def test_the_guess_games_environment_tells_the_last_digit_and_its_control_only_wrong():
    game, blind = Guess(eval_episodes=4, max_turns=3), GuessBlind(eval_episodes=4, max_turns=3)
    problem = {"prompt": "...", "answer": "437"}
    assert game.respond(problem, "440") == "Wrong: my number ends in 7. Guess again."
    assert blind.respond(problem, "440") == blind.respond(problem, "435") == "Wrong. Guess again."
    assert game.respond(problem, "I think 437") is None and blind.respond(problem, "437") is None   # solved: ends
    # the guess is read after the environment's last turn, whose digit is not the model's guess
    hinted = "440\nuser\nWrong: my number ends in 7. Guess again.\nassistant\n"
    assert game.respond(problem, hinted + "I do not know") == game.respond(problem, hinted + "447") == \
        "Wrong: my number ends in 7. Guess again." and game.respond(problem, hinted + "It is 437") is None
    assert game.respond(problem, "no idea") == "Wrong: my number ends in 7. Guess again."
    assert game.score(problem, "440\n437", 9) == 1.0 and game.score(problem, "437\n440", 9) == 0.0  # the last
    draws = game.sample(300, np.random.default_rng(0))
    for p in draws:                                        # the secret lies in the 10 numbers the prompt states
        lo, hi = (int(w) for w in p["prompt"].split("from ")[1].split(".")[0].split(" to "))
        assert lo <= int(p["answer"]) <= hi == lo + 9
    assert len({p["prompt"] for p in draws}) > 200 and len(game.eval_set) == 4   # a tenth of 490 held out
    assert game.env is game and Guess(eval_episodes=4).env is None and TASKS["guess_blind"] is GuessBlind


@pytest.mark.slow
def test_an_async_trainer_and_worker_play_the_game_in_turns_over_loopback(smollm2, tmp_path):  # noqa: F811
    """SmolLM2 plays Guess in up to 3 turns on a rollout worker (a real process, HF sampler, fp32), which
    posts its batches to a trainer on loopback: the turn holes pass the gate (nothing refused, nothing
    dropped), and the trainer's recomputed log-probs match the worker's at every trained position."""
    port = free_port()
    common = ["--task", "guess", "--model", smollm2, "--algo", "grpo", "--group-size", 4, "--n-prompts", 2,
              "--max-new-tokens", 48, "--max-turns", 3, "--lora", "--lora-r", 8, "--max-staleness", 1]
    trainer = start("--role", "trainer", "--serve-port", port, "--out", tmp_path / "g", "--steps", 2,
                    "--eval-every", 0, "--solve-at", 0, "--batch-timeout", 300, *common, log=tmp_path / "trainer.log")
    worker, = workers(port, 1, *common, tmp=tmp_path, patience=120)   # SmolLM2 loads
    try:
        assert wait(trainer, 600) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        assert wait(worker, 120) == 0, (tmp_path / "worker0.log").read_text()[-3000:]
    finally:
        for p in (trainer, worker):
            p.kill()
    steps = [r for r in rows(tmp_path / "g.csv") if r["step"] != "0"]
    print("\nturns " + ", ".join(r["turns"] for r in steps) + "; logp_gap " + ", ".join(r["logp_gap"] for r in steps))
    assert len(steps) == 2 and int(steps[-1]["refused"]) == 0 and int(steps[-1]["dropped_stale"]) == 0
    gaps = [float(r["logp_gap"]) for r in steps]                  # fp32 KV-cached decoding vs one forward
    assert any(float(r["turns"]) > 1 for r in steps) and max(gaps) < 1e-4 and any(g > 0 for g in gaps)
