"""Environment turns (--max-turns, --max-turn-tokens): the model ends its turn, the episode's environment
answers as the next user turn (inserted ids, mask 0), the model goes on. HFPolicy's batched loop on the tiny
LM the project builds, with scripted environments; the turns that end at one decoding step stepped in one
call, concurrently; an environment that fails; the text the verifiers read; the turns column; the Guess game;
SmolLM2's turns."""
import itertools
import json
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

pytest.importorskip("transformers", reason="the LLM path needs: pip install -r requirements-llm.txt")
from core import Batch  # noqa: E402
from tasks import TASKS, Addition, EnvFailed, Guess, GuessBlind, GuessGame, LLMTask, Multiply  # noqa: E402

from test_async import rows, start, wait, workers  # noqa: E402
from test_dist import free_port  # noqa: E402
from test_llm import as_batch, policy, tiny  # noqa: E402, F401
from test_smollm2 import pol, smollm2  # noqa: E402, F401
from test_tools import lively  # noqa: E402
from test_train import ROOT  # noqa: E402


class Scripted:
    """One episode's environment (a TEST DOUBLE, named so: tasks.LLMTask.environment's protocol, scripted)
    that answers each turn with `say` until it has had `turns` turns, rewarding each `reward`, and records the
    text of every turn it was stepped with. A test object because the tiny random LM plays no game; the
    sampler, the task's take_turns and play are the real ones."""

    def __init__(self, say="7 7", turns=99, reward=None):
        self.say, self.turns, self.reward, self.texts, self.closed = say, turns, reward, [], False

    def reset(self, problem):
        self.texts = []

    def step(self, text):
        self.texts.append(text)
        return (self.say if len(self.texts) < self.turns else None), self.reward

    def close(self):
        self.closed = True


class Turns:
    """What a task hands the sampler as env= for turns without tools: max_turn_tokens and tasks.take_turns
    itself (the code under test, borrowed as LLMTask has it); it records which rows each call stepped."""
    tool_stop = None

    def __init__(self, max_turn_tokens=10**6):
        self.max_turn_tokens, self.calls = max_turn_tokens, []

    def take_turns(self, episodes, texts):
        self.calls.append([e.row for e in episodes])
        return LLMTask.take_turns(episodes, texts)


def episodes(envs, max_turns):
    """One episode per row as tasks.play starts them (its env reset), and row: the row's index."""
    for env in envs:
        env.reset(None)
    return [SimpleNamespace(env=env, row=i, problem=None, max_turns=max_turns, turns=1, reward=None,
                            failed=None) for i, env in enumerate(envs)]


def turn_policy(tiny, **kw):  # noqa: F811
    """The tiny LM, redrawn lively, whose turn ends at a '2' too (a test setting: its random weights rarely
    write <|endoftext|>, and a '2' comes every few tokens)."""
    pol = lively(policy(tiny, **kw))
    pol.eos = [1, pol.tok.convert_tokens_to_ids("2")]
    return pol


# a chat template for the tiny LM: a turn is its role's initial, its text and <|endoftext|> (id 1)
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}{{ m['content'] }}<|endoftext|>{% endfor %}"
            "{% if add_generation_prompt %}a{% endif %}")


def spans(sampled):
    """[C] bool -> the [start, end) of each run of the model's own ids: its turns, when no tool is called."""
    out, j = [], 0
    for own, run in itertools.groupby(sampled.tolist()):
        n = len(list(run))
        if own:
            out.append((j, j + n))
        j += n
    return out


def test_rows_that_end_after_1_2_and_3_turns_are_token_in_token_out_and_score_as_sampled(tiny):  # noqa: F811
    """One batch, rows of 1, 2 and 3 turns (the third's environment would go on: --max-turns 3 ends it): each
    row is its sampled ids with the message's own ids after each end of turn but the last (mask 0, log-prob
    0), each step got exactly the decoded text of its own turn, the last turn's too (for its reward), and a
    fresh forward over the whole episode gives the sampler's log-probs at every trained position: the KV cache
    stayed valid."""
    pol = turn_policy(tiny, max_new_tokens=40)
    say = pol.tok("7 7", add_special_tokens=False)["input_ids"]
    envs = [Scripted(turns=1), Scripted(turns=2), Scripted(turns=99)]
    prompts = [pol.encode(p) for p in ("1=", "77 0 5 4=", "3 8 1=")]
    torch.manual_seed(0)
    samples = pol.act(prompts, 1, env=Turns(), episodes=episodes(envs, max_turns=3))
    for (c, lp, sampled, truncated), env, n in zip(samples, envs, (1, 2, 3)):
        assert not truncated, "a row ran out of budget: raise max_new_tokens"
        ids, own = c.tolist(), sampled.tolist()
        stops = [i for i, t in enumerate(ids) if t in pol.eos and own[i]]
        assert len(stops) == n and stops[-1] == len(ids) - 1           # each turn ends; the last is the end
        for s in stops[:-1]:                                           # then the message, inserted
            assert ids[s + 1:s + 1 + len(say)] == say and own[s + 1:s + 1 + len(say)] == [False] * len(say)
        assert sum(own) == len(ids) - len(say) * (n - 1)               # nothing else inserted
        assert (lp[~sampled] == 0).all() and (lp[sampled] < 0).all()
        starts = [0] + [s + 1 + len(say) for s in stops[:-1]]          # a turn: its first id to its end id
        assert env.texts == [pol.decode(ids[a:s + 1]) for a, s in zip(starts, stops)]
    batch = as_batch(prompts, samples, 1)
    assert batch.turns(pol.eos).tolist() == [1, 2, 3] and batch.insertions().tolist() == [0, 1, 2]
    # fp32 rounding of the lively weights' large logits (~1e-5 without turns too); a stale cache gives O(1)
    assert (pol.logprobs(batch)[0] - batch.logp).abs().max() < 1e-4


def test_greedy_plays_the_same_turns_and_a_turn_that_does_not_fit_ends_the_episode_truncated(
        tiny):  # noqa: F811
    pol = turn_policy(tiny, max_new_tokens=40)
    prompts = [pol.encode("3 8 1=")]                                   # turn 1 ends at EOS
    c, _, sampled, truncated = pol.act(prompts, 1, greedy=True, env=Turns(),
                                       episodes=episodes([Scripted(turns=2)], 2))[0]
    first = pol.act(prompts, 1, greedy=True)[0][0].tolist()            # the first turn, alone
    head = first + pol.tok("7 7", add_special_tokens=False)["input_ids"]
    rest = pol.act([prompts[0] + head], 1, greedy=True)[0][0].tolist()  # greedy from the whole episode
    assert c.tolist() == head + rest[:40 - len(head)] and not truncated
    # a budget that ends inside the inserted turn: the episode ends at the first turn's end, truncated, with
    # no forward after it (feeding the turn's ids would only have them dropped: vLLM's rule too)
    short = turn_policy(tiny, max_new_tokens=len(first) + 2)
    forwards = []
    short.model.register_forward_pre_hook(lambda *a: forwards.append(1))
    c, _, sampled, truncated = short.act(prompts, 1, greedy=True, env=Turns(),
                                         episodes=episodes([Scripted(turns=2)], 2))[0]
    assert c.tolist() == first and sampled.all() and truncated and len(forwards) == len(first)


class OneDevice(TorchFunctionMode):
    """Fails an op whose tensor arguments (0-dim ones aside, as CUDA allows) live on different devices, as
    CUDA does: torch.isin(a CUDA batch, a CPU tensor) raised after a --max-turns run's first update."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device for t in pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t) and t.dim()}
        assert len(devices) <= 1, f"{getattr(func, '__name__', func)} mixes {devices}"
        return func(*args, **kwargs)


def test_every_tensor_a_turn_step_makes_follows_the_policys_device(tiny):  # noqa: F811
    """No GPU here: the policy and its batch live on the CPU while torch's default device is 'meta', so a
    tensor built without device= (torch.tensor(eos) in Batch.turns was one) lands on another device than the
    batch, which OneDevice refuses. The whole step: sampling with turns, the log-probs, the logged statistics
    (turns, insertions, dead groups), the advantage and the update with its teacher term. Audited the same way
    by reading: every torch.tensor / arange / zeros in model.py, core.py, algos.py and train.update."""
    from algos import grpo
    from train import Config, batch_stats, update
    from utils import Adam
    pol = turn_policy(tiny, max_new_tokens=12)
    prompts = [pol.encode(p) for p in ("1=", "3 8 1=")]
    torch.manual_seed(0)
    cfg = Config(task="guess", model=tiny, algo="grpo", group_size=2, max_turns=2, teacher=tiny,
                 distill_coef=0.5)
    with torch.device("meta"), OneDevice():
        samples = pol.act(prompts, 2, env=Turns(), episodes=episodes([Scripted() for _ in range(4)], 2))
    batch = as_batch(prompts, samples, 2)
    assert batch.turns(pol.eos).max() == 2, "no turn happened: pick other prompts"
    with torch.device("meta"), OneDevice():
        stats = batch_stats(batch, cfg, pol)
        adv = grpo(batch, pol, std_norm=True)[0]
        update(pol, Adam(list(pol.param_groups().values()), lr=1e-3), batch, adv, None, cfg, 12, None,
               pol.logprobs(batch)[0].detach())
    assert stats["turns"] > 1


def test_a_turn_ended_by_another_eos_id_gets_the_templates_own_end_first(tiny):  # noqa: F811
    """Qwen lists two EOS ids; its template ends an assistant turn with <|im_end|>. After a turn the model
    ended with the template's own id, the inserted ids are the user turn and the assistant header; after one
    ended with the other id, the template's end id comes first, as the template renders a finished turn. Here
    the tiny LM with a template that ends turns with <|endoftext|> (id 1), and '2' as its second EOS id."""
    pol = turn_policy(tiny, max_new_tokens=24)
    pol.tok.chat_template = TEMPLATE
    two = pol.tok.convert_tokens_to_ids("2")
    after_own = pol.turn_ids("7 7", 1)
    assert pol.turn_ids("7 7", two) == [1] + after_own and pol.decode(after_own) == pol.decode(
        pol.tok.encode("u7 7<|endoftext|>a", add_special_tokens=False))
    torch.manual_seed(0)
    samples = pol.act([pol.encode("3 8 1=")] * 8, 1, env=Turns(),
                      episodes=episodes([Scripted() for _ in range(8)], 2))
    ends = [(c.tolist(), i) for c, _, sampled, _ in samples for i, own in enumerate(sampled.tolist())
            if own and c[i] in pol.eos and i + 1 < len(c) and not sampled[i + 1]]
    assert {c[i] for c, i in ends} == {1, two}, "both ids should end a turn somewhere: pick another seed"
    for c, i in ends:
        inserted = after_own if c[i] == 1 else [1] + after_own
        assert c[i + 1:i + 1 + len(inserted)] == inserted


def test_the_turns_that_end_at_one_decoding_step_are_stepped_in_one_call(tiny):  # noqa: F811
    """8 rows sampled, up to 3 turns of at most 6 tokens each: a row's completion id j was made at decoding
    step j (an inserted id takes a step too), so the steps where turns ended are read off the sampled ids (a
    run of the model's own ids ends). Each such step made exactly one take_turns call, with exactly the rows
    whose turn ended there, in row order, and each environment got its own turns' texts."""
    pol = turn_policy(tiny, max_new_tokens=60)
    envs, turns = [Scripted() for _ in range(8)], Turns(max_turn_tokens=6)
    prompts = [pol.encode(p) for p in ("1=", "77 0 5 4=", "3 8 1=", "0 0=")]
    torch.manual_seed(0)
    samples = pol.act(prompts, 2, env=turns, episodes=episodes(envs, 3))
    ended = {}                                          # decoding step -> the rows whose turn ended there
    for b, ((c, _, sampled, truncated), env) in enumerate(zip(samples, envs)):
        assert not truncated                            # 3 turns of <= 6 ids and 2 user turns of 3 fit in 60
        for a, e in spans(sampled):
            ended.setdefault(e - 1, []).append(b)
            assert e - a <= 6
        assert env.texts == [pol.decode(c[a:e].tolist()) for a, e in spans(sampled)] and len(env.texts) == 3
    assert turns.calls == [ended[j] for j in sorted(ended)]
    assert max(map(len, turns.calls)) > 1, "no two rows ended a turn at one step: pick another seed"


class Gathering(Scripted):
    """A Scripted episode (a TEST DOUBLE) whose reset and first step wait at a barrier shared by n episodes
    (a slow server's reply, as it were): they pass only if all n calls are in flight at once; called one after
    another, the first waits alone until the barrier's timeout breaks it and BrokenBarrierError is raised."""

    def __init__(self, barrier):
        super().__init__(turns=2)
        self.barrier = barrier

    def reset(self, problem):
        self.barrier.wait()
        super().reset(problem)

    def step(self, text):
        if not self.texts:
            self.barrier.wait()
        return super().step(text)


class Played(LLMTask):
    """A task with no verifier, scored by its environment alone: make(problem), the test's scripted one. Its
    problems: a number and '=', in the tiny LM's characters."""

    def __init__(self, make, **kwargs):
        self.make = make
        super().__init__(**kwargs)

    def problem(self, rng):
        return {"prompt": f"{rng.integers(10, 1000)}=", "answer": ""}

    def environment(self, problem):
        return self.make(problem)


def test_a_rollouts_environments_reset_together_and_the_turns_ending_together_step_together(
        tiny):  # noqa: F811
    """4 greedy episodes of one problem end their first turn at the same step: their resets, and then their
    steps, meet at a barrier of 4 (10 s timeout), which they pass only if the calls run concurrently."""
    barrier = threading.Barrier(4, timeout=10)
    made = []
    task = Played(lambda p: made.append(Gathering(barrier)) or made[-1], eval_episodes=10, max_new_tokens=40,
                  max_turns=2)
    b = task.rollout(turn_policy(tiny, max_new_tokens=40), task.eval_set[:1], 4, greedy=True)
    assert len(made) == 4 and all(len(env.texts) == 2 and env.closed for env in made)
    assert b.insertions().tolist() == [1] * 4 and not barrier.broken


class Failing(Scripted):
    """A Scripted episode (a TEST DOUBLE) of 3 turns, rewarding 0.25 a turn, that raises at its problem's
    fail_at-th step (0: never): EnvFailed (its server is gone, as it were) or, if the problem says so, a
    KeyError (a bug in it)."""

    def __init__(self, problem):
        super().__init__(turns=3, reward=0.25)
        self.problem = problem

    def step(self, text):
        out = super().step(text)
        if len(self.texts) == self.problem["fail_at"]:
            raise self.problem.get("error", EnvFailed)("the server went away")
        return out


def test_an_environment_that_fails_ends_its_episode_truncated_with_reward_0_and_a_bug_propagates(
        tiny, capsys):  # noqa: F811
    """Problem 0's 2 episodes fail at their second step: no user turn after it (1 insertion), truncated,
    reward 0 (not the 0.25 of the step before), one warning for the rollout counting them; problem 1's play
    their 3 turns, rewarded 3 x 0.25 = 0.75. Every environment is closed, the failed ones too. Any other
    exception is a bug: it propagates."""
    made = []
    task = Played(lambda p: made.append(Failing(p)) or made[-1], eval_episodes=10, max_new_tokens=40,
                  max_turns=3)
    problems = [{"prompt": "1=", "answer": "", "fail_at": 2},
                {"prompt": "3 8 1=", "answer": "", "fail_at": 0}]
    pol = turn_policy(tiny, max_new_tokens=40)
    torch.manual_seed(0)
    b = task.rollout(pol, problems, 2)
    assert [len(env.texts) for env in made] == [2, 2, 3, 3] and all(env.closed for env in made)
    assert b.insertions().tolist() == [1, 1, 2, 2] and b.truncated.tolist() == [True, True, False, False]
    assert b.rewards.sum(1).tolist() == [0.0, 0.0, 0.75, 0.75]
    for row in range(2):                                # a failed episode ends at the turn it failed on
        last = int(b.mask[row].nonzero().max())
        assert b.states[row, last] in pol.eos
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1
    assert warnings[0].startswith("warning: 2 of 4 episodes failed (the server went away)")
    with pytest.raises(KeyError, match="the server went away"):
        task.rollout(pol, [{"prompt": "1=", "answer": "", "fail_at": 1, "error": KeyError}], 2)


def test_a_turn_cut_at_max_turn_tokens_ends_there_and_the_templates_end_id_comes_first(tiny):  # noqa: F811
    """--max-turn-tokens 5 on the tiny LM with a chat template (id 1 ends a turn, '2' too): no turn of the
    model is longer than 5 ids; after a turn cut there (its last id no end id) come the template's end id, the
    user turn and the assistant header; the environment got the cut turn's text; a fresh forward gives the
    sampler's log-probs; and Batch.turns counts the cut turns (the turns column): 3 turns in each row."""
    pol = turn_policy(tiny, max_new_tokens=48)
    pol.tok.chat_template = TEMPLATE
    envs = [Scripted() for _ in range(8)]
    prompts = [pol.encode(p) for p in ("1=", "77 0 5 4=", "3 8 1=", "0 0=")]
    torch.manual_seed(0)
    samples = pol.act(prompts, 2, env=Turns(max_turn_tokens=5), episodes=episodes(envs, 3))
    after_own, cut = pol.turn_ids("7 7", 1), 0
    for (c, _, sampled, truncated), env in zip(samples, envs):
        ids, turns = c.tolist(), spans(sampled)
        assert not truncated and len(turns) == 3 and env.texts == [pol.decode(ids[a:e]) for a, e in turns]
        for a, e in turns:
            assert e - a <= 5
            if ids[e - 1] not in pol.eos and e < len(ids):          # cut, and the episode goes on
                cut += 1
                assert e - a == 5 and ids[e:e + 1 + len(after_own)] == [1] + after_own
    assert cut > 0, "no turn reached 5 ids: pick another seed"
    batch = as_batch(prompts, samples, 2)
    assert batch.turns(pol.eos).tolist() == [3] * 8
    assert (pol.logprobs(batch)[0] - batch.logp).abs().max() < 1e-4


def test_turns_without_tools_decode_text_only_where_a_turn_ended(tiny):  # noqa: F811
    """--max-turns without --max-tool-calls: the sampler looks for no call, so it decodes a row's text only
    where a turn ended (for the environment), not after every token (it did: the task's tool_stop '=' was set
    anyway). Guess's real games, through the task's rollout; only the sampler's decodes counted."""
    pol = turn_policy(tiny, max_new_tokens=24)
    game, decoded, decode, act = Guess(eval_episodes=2, max_turns=3), [], pol.decode, pol.act

    def counting(*args, **kwargs):
        pol.decode = lambda ids: decoded.append(len(ids)) or decode(ids)
        try:
            return act(*args, **kwargs)
        finally:
            pol.decode = decode
    pol.act = counting
    torch.manual_seed(0)
    b = game.rollout(pol, game.sample(4, np.random.default_rng(0)), 2)
    turn_ends = int((torch.isin(b.states, torch.tensor(pol.eos)) & (b.mask > 0)).sum())
    assert 0 < len(decoded) <= turn_ends < b.mask.sum() / 2


def test_turns_by_hand():
    """turns = end-of-turn ids trained + the inserted ones that end a turn cut at --max-turn-tokens (an end id
    first in an insertion, not after a trained one) + 1 if cut mid-turn; insertions = runs of 0s between 1s
    (eos ids 9 and 8, the template's 9: after the model's 8 the template writes its own 9 first)."""
    mask = torch.tensor([[0, 1, 1, 0, 0, 0, 0.0],  # 1 turn, ended:                  [_, 5, 9]
                         [0, 1, 0, 1, 1, 1, 0],    # 2 turns, the last cut:          [_, 9, (7), 5, 5, 5]
                         [0, 1, 0, 1, 0, 1, 0],    # 3 turns, ended:                 [_, 9, (7), 9, (7), 9]
                         [0, 1, 1, 0, 0, 1, 1],    # 2 turns, the first capped:      [_, 5, 5, (9, 7), 5, 9]
                         [0, 1, 0, 0, 1, 1, 0]])   # 2 turns, the first ended by 8:  [_, 8, (9, 7), 5, 9]
    states = torch.tensor([[3, 5, 9, 0, 0, 0, 0], [3, 9, 7, 5, 5, 5, 0], [3, 9, 7, 9, 7, 9, 0],
                           [3, 5, 5, 9, 7, 5, 9], [3, 8, 9, 7, 5, 9, 0]])
    batch = Batch(states, states, torch.zeros(5, 7), torch.zeros(5, 7), mask, torch.zeros(5, dtype=bool),
                  None, 1)
    assert batch.turns([9, 8]).tolist() == [1, 2, 3, 2, 2] and batch.insertions().tolist() == [0, 1, 2, 1, 1]


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
    assert graded(turns, answers) == "50\n75"
    assert turns.score({"prompt": "", "answer": "75"}, "50\n75", 4) == 1.0


def test_max_turns_and_max_turn_tokens_need_a_task_with_an_environment_and_turns_alone_look_for_no_call():
    """--max-turns or --max-turn-tokens on a task that answers no turn (no environment()) did nothing,
    silently: refused now. A task with turns and no tools gets no tool_stop, so the sampler decodes nothing to
    look for a call. --max-turn-tokens 0 is the whole --max-new-tokens."""
    from train import Config, validate
    problem = Addition(eval_episodes=2).eval_set[0]
    assert Addition(eval_episodes=2).environment(problem) is None
    refused = "^--max-turns and --max-turn-tokens: --task addition has no environment to answer a turn"
    for flag in ({"max_turns": 3}, {"max_turn_tokens": 8}):
        with pytest.raises(ValueError, match=refused):
            validate(Config(task="addition", model="m", algo="grpo", group_size=2, **flag))
    validate(Config(task="guess", model="m", algo="grpo", group_size=2, max_turns=3, max_turn_tokens=8))
    tools, game = Addition(eval_episodes=2, max_tool_calls=1), Guess(eval_episodes=2, max_turns=3)
    assert tools.tool_stop == "=" and tools.max_turns == 1 and game.tool_stop is None
    assert isinstance(game.environment(game.eval_set[0]), GuessGame)
    assert game.max_turn_tokens == 256 and Guess(eval_episodes=2, max_turn_tokens=8).max_turn_tokens == 8


def test_the_turn_budget_is_a_setting_trainer_and_workers_share():
    """A worker of another --max-turns or --max-turn-tokens is refused: a trainer on loopback serves
    --max-turns 3's fingerprint, and the worker's check (serve.TrainerClient.check, over HTTP) of --max-turns
    2 raises naming the setting, of 3 passes. The trainer's gate takes --max-tool-calls + --max-turns - 1
    holes a row (test_serve sends them)."""
    from serve import TrainerClient, TrainerServer
    from tasks import CartPole
    from test_serve import LLM_LIMITS
    from train import Config, batch_limits, fingerprint
    trainer = Config(task="guess", max_turns=3)
    server = TrainerServer("t", fingerprint(trainer, 2), 2, host="127.0.0.1", port=0,
                           limits=LLM_LIMITS).start()
    try:
        server.publish(1, {"w": torch.zeros(3)})
        client = TrainerClient(f"http://127.0.0.1:{server.port}", "t", patience=1)
        client.check(fingerprint(trainer, 2), {"w": [[3], "float32"]})
        with pytest.raises(ValueError,
                           match="differ, refusing to run: setting 'max_turns': trainer 3, worker 2$"):
            client.check(fingerprint(Config(task="guess", max_turns=2), 2), {"w": [[3], "float32"]})
        with pytest.raises(ValueError, match="setting 'max_turn_tokens': trainer 0, worker 8$"):
            client.check(fingerprint(Config(task="guess", max_turns=3, max_turn_tokens=8), 2),
                         {"w": [[3], "float32"]})
    finally:
        server.stop()
    assert batch_limits(Config(max_turns=3, max_tool_calls=2), CartPole(), None, 2)["insertions"] == 4


class FixedSeed:
    """An rng whose integers() draws the given seed: the problem Guess deals from that seed alone."""

    def __init__(self, seed):
        self.seed = seed

    def integers(self, *args):
        return self.seed


def test_the_guess_games_environment_tells_the_last_digit_and_its_control_only_wrong():
    """A game per episode (reset: its secret), the guess read from the turn's own text alone (the step gets no
    earlier turn, and no user turn, whose digit is not the model's guess): the last number in it. Right: the
    episode ends with reward 1; wrong: reward 0 and the hint (Guess) or only 'wrong' (GuessBlind, the
    control)."""
    problem = {"prompt": "...", "answer": "437", "seed": 1}
    game, blind = Guess(eval_episodes=4, max_turns=3), GuessBlind(eval_episodes=4, max_turns=3)
    env, other = game.environment(problem), blind.environment(problem)
    env.reset(problem)
    other.reset(problem)
    wrong = ("Wrong: my number ends in 7. Guess again.", 0.0)
    assert env.step("440") == env.step("I do not know") == env.step("437 or 447") == wrong
    assert other.step("440") == other.step("435") == ("Wrong. Guess again.", 0.0)
    assert env.step("I think 437") == other.step("437") == (None, 1.0)     # solved: the episode ends
    assert env.step("7") == wrong                       # a turn's text alone: the hint's digit is no guess
    again = game.environment(problem)                   # each episode its own game: reset deals its secret
    again.reset({**problem, "answer": "12"})
    assert again.step("437") == ("Wrong: my number ends in 2. Guess again.", 0.0)
    assert again.step("12") == (None, 1.0)
    assert env.step("437") == (None, 1.0)               # the first game kept its own secret
    # scored by the game: its steps' summed reward (1: solved), 0 if it failed; no verifier reads the text
    assert game.rewards == [] and game.reward_range == (0.0, 1.0)
    ep = lambda reward, failed=None: SimpleNamespace(reward=reward, failed=failed)
    assert [game.score(problem, "437", 9, e) for e in (ep(1.0), ep(0.0), ep(None), ep(1.0, EnvFailed()))] == \
        [1.0, 0.0, 0.0, 0.0]
    assert TASKS["guess_blind"] is GuessBlind and TASKS["guess"] is Guess


def test_guess_deals_each_game_from_its_seed_within_the_stated_range_and_holds_out_a_tenth():
    game = Guess(eval_episodes=4)
    draws = game.sample(300, np.random.default_rng(0))
    for p in draws:                                     # the secret lies in the 10 numbers the prompt states
        lo, hi = (int(w) for w in p["prompt"].split("from ")[1].split(".")[0].split(" to "))
        assert lo <= int(p["answer"]) <= hi == lo + 9
        assert game.problem(FixedSeed(p["seed"])) == p  # a game is its seed's: a server deals it again
    assert len({p["prompt"] for p in draws}) > 200 and len({p["seed"] for p in draws}) == 300
    assert len(game.eval_set) == 4 and all(game.problem(FixedSeed(p["seed"])) == p for p in game.eval_set)
    from tasks import held_out                  # a tenth of the 490 ranges held out: never a training draw
    assert all(held_out(p["prompt"]) for p in game.eval_set) and not any(held_out(p["prompt"]) for p in draws)
    assert {p["prompt"] for p in Guess(eval_episodes=4).eval_set} == {p["prompt"] for p in game.eval_set}


def test_a_system_prompt_is_written_on_a_line_before_the_prompt_without_a_chat_template(tiny):  # noqa: F811
    """A task's system prompt: with no chat template, its text and a newline before the prompt (the tiny
    tokenizer has no newline: <|unk|>, id 2). The task's prompt_ids pass it, tools' hint or not."""
    pol = policy(tiny)

    class Told(Played):
        system = "7 7"
    task = Told(lambda p: Scripted(), eval_episodes=10)
    assert pol.encode("1=", "7 7") == pol.encode("7 7") + [2] + pol.encode("1=") == [10, 13, 10, 2, 4, 14]
    assert task.prompt_ids(pol.encode, [{"prompt": "1="}]) == [pol.encode("7 7\n1=")]


@pytest.mark.slow
def test_a_system_prompt_is_the_chat_templates_system_turn(pol):  # noqa: F811
    """SmolLM2: a task's system prompt is rendered as the template's system turn, in place of the template's
    default one (shown when the task has none), the same ids as the tokenizer's own chat template gives."""
    class Terse(Addition):
        system = "Answer with the number only."
    problem = {"prompt": "What is 1 + 2?", "answer": "3"}
    ids = Terse(eval_episodes=4).prompt_ids(pol.encode, [problem])[0]
    assert pol.tok.decode(ids) == ("<|im_start|>system\nAnswer with the number only.<|im_end|>\n"
                                   "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n")
    chat = [{"role": "system", "content": Terse.system}, {"role": "user", "content": problem["prompt"]}]
    assert ids == pol.tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    plain = Addition(eval_episodes=4).prompt_ids(pol.encode, [problem])[0]
    assert pol.tok.decode(plain).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


class Recorded(GuessGame):
    """GuessGame (the real one) recording each step: the turn's text and the game's answer."""

    def reset(self, problem):
        super().reset(problem)
        self.steps = []

    def step(self, text):
        self.steps.append((text, super().step(text)))
        return self.steps[-1][1]


@pytest.mark.slow
def test_an_evaluations_records_show_the_games_turns_user_first_as_decoded(pol):  # noqa: F811
    """SmolLM2 plays 8 held-out games of Guess, 3 turns, greedy: each record's turns are the prompt (user),
    then assistant and user in turn: each assistant turn the very text its game was stepped with, each user
    turn the game's answer as the chat template renders it (decoded: role names, no special tokens); correct
    iff the game was won, its reward the game's."""
    made = []

    class Watched(Guess):
        def environment(self, problem):
            made.append(Recorded(self.informative))
            return made[-1]
    game = Watched(eval_episodes=8, max_turns=3, max_new_tokens=48)
    pol.max_new_tokens = 48
    try:
        records = game.evaluate(pol)["samples"]
    finally:
        pol.max_new_tokens = 16
    assert len(records) == len(made) == 8
    for r, env, p in zip(records, made, game.eval_set):
        assert r["correct"] == (r["reward"] == 1.0) == any(out == (None, 1.0) for _, out in env.steps)
        assert r["prompt"] == p["prompt"]
        if "turns" not in r:                            # one turn: won, or no room for another
            continue
        turns = r["turns"]
        assert turns[0] == {"role": "user", "text": p["prompt"]}
        assert [t["role"] for t in turns] == ["user", "assistant"] * (len(turns) // 2)
        said = [t["text"] for t in turns[1::2]]         # the last turn, cut by the budget, may not be stepped
        assert [text for text, _ in env.steps] == said[:len(env.steps)] and len(env.steps) >= len(said) - 1
        answers = [message for _, (message, _) in env.steps[:len(said) - 1]]
        assert [t["text"] for t in turns[2::2]] == [f"\nuser\n{m}\nassistant\n" for m in answers]
    assert any("turns" in r for r in records), "no game went past its first turn"


@pytest.mark.slow
def test_train_py_plays_guess_in_capped_turns_and_logs_its_turns(smollm2, tmp_path):  # noqa: F811
    """train.py --task guess --max-turns 3 --max-turn-tokens 8 on SmolLM2 with LoRA, 1 step: samples.jsonl's
    records (evaluation's and the training group's) show role-tagged turns from the prompt on, no assistant
    turn longer than 8 ids, and the CSV's turns column counts them."""
    import subprocess
    import sys
    out = tmp_path / "g"
    flags = ("--task guess --lora --algo grpo --group-size 2 --n-prompts 2 --max-new-tokens 40 --max-turns 3 "
             "--max-turn-tokens 8 --steps 1 --eval-every 1 --eval-episodes 4 --solve-at 0").split()
    p = subprocess.run([sys.executable, "train.py", *flags, "--model", smollm2, "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    records = [json.loads(line) for line in open(f"{out}.samples.jsonl")]
    played = [r for r in records if "turns" in r]
    assert {r["kind"] for r in played} == {"eval", "train"}, "no episode in both had a second turn"
    for r in played:
        roles = [t["role"] for t in r["turns"]]
        assert roles[:2] == ["user", "assistant"] and roles[1::2] == ["assistant"] * len(roles[1::2])
        assert roles[2::2] == ["user"] * len(roles[2::2])
        assert r["turns"][0]["text"] == r["prompt"] and len(roles) in (4, 6)
    steps = rows(f"{out}.csv")
    assert "turns" in steps[0] and 1 < float(steps[-1]["turns"]) <= 3


@pytest.mark.slow
def test_an_async_trainer_and_worker_play_the_game_in_turns_over_loopback(smollm2, tmp_path):  # noqa: F811
    """SmolLM2 plays Guess in up to 3 turns on a rollout worker (a real process, HF sampler, fp32), which
    posts its batches to a trainer on loopback: the turn holes pass the gate (nothing refused, nothing
    dropped), and the trainer's recomputed log-probs match the worker's at every trained position."""
    port = free_port()
    common = ["--task", "guess", "--model", smollm2, "--algo", "grpo", "--group-size", 4, "--n-prompts", 2,
              "--max-new-tokens", 48, "--max-turns", 3, "--lora", "--lora-r", 8, "--max-staleness", 1,
              "--every-row"]     # every row scored, whatever the rewards: the gap at every trained position
    trainer = start("--role", "trainer", "--serve-port", port, "--out", tmp_path / "g", "--steps", 2,
                    "--eval-every", 0, "--solve-at", 0, "--batch-timeout", 300, *common,
                    log=tmp_path / "trainer.log")
    worker, = workers(port, 1, *common, tmp=tmp_path, patience=120)   # SmolLM2 loads
    try:
        assert wait(trainer, 600) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        assert wait(worker, 120) == 0, (tmp_path / "worker0.log").read_text()[-3000:]
    finally:
        for p in (trainer, worker):
            p.kill()
    steps = [r for r in rows(tmp_path / "g.csv") if r["step"] != "0"]
    print("\nturns " + ", ".join(r["turns"] for r in steps) + "; logp_gap "
          + ", ".join(r["logp_gap"] for r in steps))
    assert len(steps) == 2 and int(steps[-1]["refused"]) == 0 and int(steps[-1]["dropped_stale"]) == 0
    gaps = [float(r["logp_gap"]) for r in steps]                  # fp32 KV-cached decoding vs one forward
    assert any(float(r["turns"]) > 1 for r in steps) and max(gaps) < 1e-4 and any(g > 0 for g in gaps)
