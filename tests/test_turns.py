"""Environment turns (--max-turns): the model ends its turn, the task's environment answers as the next user
turn (inserted ids, mask 0), the model goes on. HFPolicy's batched loop on the tiny LM the project builds,
with a scripted environment; the text the verifiers read; the turns column."""
import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

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
    # a budget that ends inside the inserted turn: the episode ends at the first turn's end, truncated, with
    # no forward after it (feeding the turn's ids would only have them dropped: vLLM's rule too)
    short = turn_policy(tiny, max_new_tokens=len(first) + 2)
    forwards = []
    short.model.register_forward_pre_hook(lambda *a: forwards.append(1))
    c, _, sampled, truncated = short.act(prompts, 1, greedy=True, env=ScriptedEnv(2), problems=one)[0]
    assert c.tolist() == first and sampled.all() and truncated and len(forwards) == len(first)


class OneDevice(TorchFunctionMode):
    """Fails an op whose tensor arguments (0-dim ones aside, as CUDA allows) live on different devices, as CUDA
    does: torch.isin(a CUDA batch, a CPU tensor) raised after a --max-turns run's first update."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device for t in pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t) and t.dim()}
        assert len(devices) <= 1, f"{getattr(func, '__name__', func)} mixes {devices}"
        return func(*args, **kwargs)


def test_every_tensor_a_turn_step_makes_follows_the_policys_device(tiny):  # noqa: F811
    """No GPU here: the policy and its batch live on the CPU while torch's default device is 'meta', so a tensor
    built without device= (torch.tensor(eos) in Batch.turns was one) lands on another device than the batch,
    which OneDevice refuses. The whole step: sampling with turns, the log-probs, the logged statistics (turns,
    insertions, dead groups), the advantage and the update with its teacher term. Audited the same way by
    reading: every torch.tensor / arange / zeros in model.py, core.py, algos.py and train.update."""
    from algos import grpo
    from train import Config, batch_stats, update
    from utils import Adam
    pol = turn_policy(tiny, max_new_tokens=12)
    problems = [{"id": i, "turns": 2, "say": "7 7"} for i in range(2)]
    prompts = [pol.encode(p) for p in ("1=", "3 8 1=")]
    torch.manual_seed(0)
    cfg = Config(task="guess", model=tiny, algo="grpo", group_size=2, max_turns=2, teacher=tiny, distill_coef=0.5)
    with torch.device("meta"), OneDevice():
        samples = pol.act(prompts, 2, env=ScriptedEnv(max_turns=2), problems=problems)
    batch = as_batch(prompts, samples, 2)
    assert batch.turns(pol.eos).max() == 2, "no turn happened: pick other prompts"
    with torch.device("meta"), OneDevice():
        stats = batch_stats(batch, cfg, pol)
        adv = grpo(batch, pol, std_norm=True)[0]
        update(pol, Adam(list(pol.param_groups().values()), lr=1e-3), batch, adv, None, cfg, 12, None,
               pol.logprobs(batch)[0].detach())
    assert stats["turns"] > 1


def test_a_turn_ended_by_another_eos_id_gets_the_templates_own_end_first(tiny):  # noqa: F811
    """Qwen lists two EOS ids; its template ends an assistant turn with <|im_end|>. After a turn the model ended
    with the template's own id, the inserted ids are the user turn and the assistant header; after one ended
    with the other id, the template's end id comes first, as the template renders a finished turn. Here the
    tiny LM with a template that ends turns with <|endoftext|> (id 1), and '2' as its second EOS id."""
    pol = turn_policy(tiny, max_new_tokens=24)
    pol.tok.chat_template = ("{% for m in messages %}{{ m['role'][0] }}{{ m['content'] }}<|endoftext|>{% endfor %}"
                             "{% if add_generation_prompt %}a{% endif %}")
    two = pol.tok.convert_tokens_to_ids("2")
    after_own = pol.turn_ids("7 7", 1)
    assert pol.turn_ids("7 7", two) == [1] + after_own and pol.decode(after_own) == pol.decode(
        pol.tok.encode("u7 7<|endoftext|>a", add_special_tokens=False))
    env, problems = ScriptedEnv(max_turns=2), [{"id": i, "turns": 2, "say": "7 7"} for i in range(8)]
    torch.manual_seed(0)
    rows = pol.act([pol.encode("3 8 1=")] * 8, 1, env=env, problems=problems)
    ends = [(c.tolist(), i) for c, _, sampled, _ in rows for i, own in enumerate(sampled.tolist())
            if own and c[i] in pol.eos and i + 1 < len(c) and not sampled[i + 1]]
    assert {c[i] for c, i in ends} == {1, two}, "both ids should end a turn somewhere: pick another seed"
    for c, i in ends:
        inserted = after_own if c[i] == 1 else [1] + after_own
        assert c[i + 1:i + 1 + len(inserted)] == inserted


def test_turns_without_tools_decode_text_only_where_a_turn_ended(tiny):  # noqa: F811
    """--max-turns without --max-tool-calls: the sampler looks for no call, so it decodes a row's text only where
    a turn ended (for the environment), not after every token (it did: the task's tool_stop '=' was set anyway)."""
    pol = turn_policy(tiny, max_new_tokens=24)
    game, decoded, decode = Guess(eval_episodes=2, max_turns=3), [], pol.decode
    pol.decode = lambda ids: decoded.append(len(ids)) or decode(ids)
    problems = game.sample(4, np.random.default_rng(0))
    torch.manual_seed(0)
    rows = pol.act([pol.encode(p["prompt"]) for p in problems], 2, env=game, problems=problems)
    turn_ends = sum(int((torch.isin(c, torch.tensor(pol.eos)) & own).sum()) for c, _, own, _ in rows)
    assert 0 < len(decoded) <= turn_ends < sum(len(c) for c, *_ in rows) / 2


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
    """A worker of another --max-turns is refused: a trainer on loopback serves --max-turns 3's fingerprint, and
    the worker's check (serve.TrainerClient.check, over HTTP) of --max-turns 2 raises naming the setting, of 3
    passes. The trainer's gate takes --max-tool-calls + --max-turns - 1 holes a row (test_serve sends them)."""
    from serve import TrainerClient, TrainerServer
    from tasks import CartPole
    from test_serve import LLM_LIMITS
    from train import Config, batch_limits, fingerprint
    trainer = Config(task="guess", max_turns=3)
    server = TrainerServer("t", fingerprint(trainer, 2), 2, host="127.0.0.1", port=0, limits=LLM_LIMITS).start()
    try:
        server.publish(1, {"w": torch.zeros(3)})
        client = TrainerClient(f"http://127.0.0.1:{server.port}", "t", patience=1)
        client.check(fingerprint(trainer, 2), {"w": [[3], "float32"]})
        with pytest.raises(ValueError, match="differ, refusing to run: setting 'max_turns': trainer 3, worker 2$"):
            client.check(fingerprint(Config(task="guess", max_turns=2), 2), {"w": [[3], "float32"]})
    finally:
        server.stop()
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
              "--max-new-tokens", 48, "--max-turns", 3, "--lora", "--lora-r", 8, "--max-staleness", 1,
              "--every-row"]     # every row scored, whatever the rewards: the gap at every trained position
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
