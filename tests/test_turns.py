"""Environment turns (--max-turns): the model ends its turn, the task's environment answers as the next user
turn (inserted ids, mask 0), the model goes on. HFPolicy's batched loop on the tiny LM the project builds,
with a scripted environment; the text the verifiers read; the turns column."""
import pytest
import torch

pytest.importorskip("transformers", reason="the LLM path needs: pip install -r requirements-llm.txt")
from core import Batch  # noqa: E402
from tasks import Addition, LLMTask, Multiply, _last_number  # noqa: E402

from test_llm import as_batch, policy, tiny  # noqa: E402, F401
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


def test_a_task_gives_the_sampler_its_environment_only_when_something_answers():
    assert Addition(eval_episodes=2).env is None
    turns, tools = Addition(eval_episodes=2, max_turns=3), Addition(eval_episodes=2, max_tool_calls=1)
    assert turns.env is turns and turns.reply("1+1=") is None and turns.respond({}, "12") is None  # no tool, 1 turn
    assert tools.env is tools and tools.tool_stop == "=" and tools.max_turns == 1


def test_the_turn_budget_is_a_setting_trainer_and_workers_share():
    """A worker of another --max-turns is refused (serve.TrainerClient.check compares the fingerprints), and the
    trainer's gate takes --max-tool-calls + --max-turns - 1 holes a row (tests/test_serve.py sends them)."""
    from tasks import CartPole
    from train import Config, batch_limits, fingerprint
    assert fingerprint(Config(max_turns=3), 2)["max_turns"] == 3 != fingerprint(Config(), 2)["max_turns"]
    assert batch_limits(Config(max_turns=3, max_tool_calls=2), CartPole(), None, 2)["insertions"] == 4


# ---- the rung's game, kept here until it lands in tasks.py with its measured rung (issue 24; branch turns-rung
# has it there, with configs/smollm2_guess_turns.yaml): an environment as a task writes one ----

def guess_reward(prompt, completion, answer):
    """1.0 iff the last number the model wrote is the secret: the game ended solved."""
    return float(_last_number(completion) == int(answer))


class Guess(LLMTask):
    """Guess the number in lo..hi (<= 100 numbers; --max-turns 7): the environment says higher or lower after
    a wrong guess, all a binary search needs (2^7 > 100). GuessBlind, the control, only says wrong."""
    rewards, informative = [(1.0, guess_reward)], True

    def problem(self, rng):
        lo = rng.integers(1, 51)
        hi = lo + rng.integers(20, 100)
        return {"prompt": f"I am thinking of a whole number from {lo} to {hi}. Guess it: answer with one "
                          f"number only. If it is wrong, I will tell you, and you guess again.",
                "answer": str(rng.integers(lo, hi + 1))}

    def respond(self, problem, text):
        """The last number in the text so far (the environment's turns have none) is the model's guess."""
        guess, secret = _last_number(text), int(problem["answer"])
        if guess == secret:
            return None
        if guess is None or not self.informative:
            return "Wrong. Guess again."
        return f"Wrong: my number is {'higher' if guess < secret else 'lower'}. Guess again."


class GuessBlind(Guess):
    informative = False


def test_the_guess_games_environment_says_higher_or_lower_and_its_control_only_wrong():
    game, blind = Guess(eval_episodes=4, max_turns=7), GuessBlind(eval_episodes=4, max_turns=7)
    problem = {"prompt": "...", "answer": "37"}
    assert game.respond(problem, "50") == "Wrong: my number is lower. Guess again."
    assert game.respond(problem, "50\nuser\nWrong: my number is lower. Guess again.\nassistant\n25") == \
        "Wrong: my number is higher. Guess again."
    assert game.respond(problem, "I think 37") is None and blind.respond(problem, "37") is None   # solved: ends
    assert blind.respond(problem, "50") == blind.respond(problem, "25") == "Wrong. Guess again."
    assert game.respond(problem, "no idea") == "Wrong. Guess again."
    assert not any(c.isdigit() for c in game.respond(problem, "50") + blind.respond(problem, "50"))
    import numpy as np
    draws = game.sample(200, np.random.default_rng(0))
    for p in draws:                                        # the secret lies in the range the prompt states
        lo, hi = (int(w) for w in p["prompt"].split("from ")[1].split(".")[0].split(" to "))
        assert lo <= int(p["answer"]) <= hi and hi - lo < 100
    assert len({p["prompt"] for p in draws}) > 150         # prompts differ: a tenth of them held out
    assert game.env is game and Guess(eval_episodes=4).env is None
