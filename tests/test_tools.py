"""Multi-turn tool use: the calculator, a task's reply(), HFPolicy feeding a reply mid-completion (on the tiny
LM the project builds), and the loss that gives a reply nothing: its tokens are context, never trained on."""
import itertools

import pytest
import torch

pytest.importorskip("transformers", reason="the LLM path needs: pip install -r requirements-llm.txt")
from core import Batch, Trajectory  # noqa: E402
from model import _buckets  # noqa: E402
from tasks import Multiply, calculator  # noqa: E402
from train import Config, policy_loss, update  # noqa: E402
from utils import Adam  # noqa: E402

from test_llm import policy, tiny  # noqa: E402, F401


def test_the_calculator_is_exact_bounded_and_never_raises():
    assert calculator(" 37*48 ") == "1776" and calculator("(1+2)*3-4") == "5" and calculator("0-7") == "-7"
    # a fraction is a decimal rounded to 6 places, by hand: never 'a/b', which a verifier's last number reads as b
    assert [calculator(e) for e in ("7/2", "1/3", "0-7/2", "2/3", "1/8", "1/3000000", "999999999998/7")] == [
        "3.5", "0.333333", "-3.5", "0.666667", "0.125", "0.", "142857142856.857143"]
    for bad, why in [("2+*3", "not an arithmetic"), ("5/0", "division by zero"), ("2**8", "not an arithmetic"),
                     ("1" * 13 + "*2", "a short expression"), ("1+" * 40 + "1", "a short expression"),
                     ("__import__('os')", "of digits"),
                     ("999999999999*" * 4 + "9", "too long")]:     # 13 nines: 60 digits
        assert calculator(bad).startswith("error: ") and why in calculator(bad), (bad, calculator(bad))
        assert not any(c.isdigit() for c in calculator(bad)), "an error's digit would be read as an answer"


def test_a_call_is_an_expression_and_equals_and_the_budget_counts_replies():
    task = Multiply(eval_episodes=2, max_tool_calls=2)
    assert task.reply("So 34 * 18 =") == "<result>612</result>"
    assert task.reply("x =") is None                                   # no digit: not a call
    assert task.reply("2+*3=") == "<result>error: not an arithmetic expression, or a division by zero</result>"
    assert task.reply("34*18=<result>612</result>, 612/2=") == "<result>306</result>"
    assert task.reply("1*1=<result>1</result> 2*2=<result>4</result> 3*3=") is None     # 2 replies: the budget
    task.tool = lambda expr: 1 / 0                                       # a user's tool that raises
    assert task.reply("1+1=") == "<result>error: ZeroDivisionError</result>"


def test_the_call_is_the_run_of_calculator_characters_before_the_equals_read_in_linear_time():
    """The expression a reply gets: the longest run of 0-9 + - * / ( ) and spaces ending at the last "=", as
    the regex [0-9+*/() -]*\\Z finds it, in linear time: the regex it replaces was quadratic on long digit runs
    (0.1 s on 4,000), and its $ also matched before a newline ("12*3\\n=" was a call)."""
    import random
    import re
    task, rng, seen = Multiply(eval_episodes=2, max_tool_calls=1), random.Random(0), []
    task.tool = lambda expr: seen.append(expr) or "ok"
    for _ in range(300):
        text = "".join(rng.choice("12 +*/()-x=a\n") for _ in range(rng.randint(0, 30))) + "="
        seen.clear()
        task.reply(text)
        want = re.search(r"[0-9+*/() -]*\Z", text.rpartition("=")[0])[0]
        assert seen == ([want] if re.search("[0-9]", want) else []), (text, seen, want)
    assert task.reply("x" + "1" * 100_000 + "y 2*3=") == "<result>ok</result>" and seen[-1] == " 2*3"


def shout(expr):
    return expr.strip() + "!"


class Shouting(Multiply):
    """As the README says a fork adds a tool: a plain function set as the task's tool."""
    tool = shout


def test_a_plain_function_set_as_a_tasks_tool_is_called_with_the_expression_alone():
    # bound as a method, it got (self, expr): every reply was '<result>error: TypeError ...' and the reward 0
    assert Shouting(eval_episodes=2, max_tool_calls=1).reply("So 34 * 18 =") == "<result>34 * 18!</result>"
    assert Multiply(eval_episodes=2, max_tool_calls=1).reply("34*18=") == "<result>612</result>"   # the default


class TwoArguments(Multiply):
    tool = staticmethod(lambda expr, base: expr)


class AMethod(Multiply):
    def tool(self, expr):
        return expr


@pytest.mark.parametrize("task", [TwoArguments, AMethod])
def test_a_tool_that_cannot_take_the_expression_fails_when_the_task_is_built_with_tools_on(task):
    with pytest.raises(ValueError, match=rf"^{task.__name__}\.tool\((expr, base|self, expr)\) cannot be called as "
                                         r"tool\(text\) -> str: make it a plain function of one argument"):
        task(eval_episodes=2, max_tool_calls=1)
    task(eval_episodes=2, max_tool_calls=0)                              # tools off: never called, not checked


class Scripted:
    """A tools object (tasks.LLMTask's protocol: tool_stop, reply(text)) that replies `reply` whenever a
    completion's text since its last call contains `stop`, and records the texts it was asked about. A test
    object because the tiny LM's random weights never write a calculator call; the sampler is the real one."""

    def __init__(self, stop, reply):
        self.tool_stop, self.answer, self.asked = stop, reply, []

    def reply(self, text):
        self.asked.append(text)
        return self.answer


def lively(pol):
    """The tiny LM's weights redrawn N(0, 1): its own init decodes '==========' from every prompt greedily,
    which can show neither a call in one row and none in another nor a continuation that depends on it."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in pol.model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return pol


def greedy(pol, prompts, tools=None):
    return pol.act(prompts, 1, greedy=True, env=tools)


def test_a_reply_is_fed_in_lockstep_token_in_token_out(tiny):  # noqa: F811
    """Row 0 calls after its first 2 tokens, row 1 never (its greedy text has no such string): row 0's trained
    ids are its 2 sampled ids, the reply's own ids, then exactly what greedy decoding continues with from that
    whole sequence as a fresh prompt (the KV cache stayed valid); row 1 is untouched; replies have mask 0."""
    pol = lively(policy(tiny, max_new_tokens=10))
    prompts = [pol.encode("1="), pol.encode("77 0 5 4=")]                 # greedy: '7 74397777', '248 2222'
    plain = [c.tolist() for c, *_ in greedy(pol, prompts)]
    stop = pol.decode(plain[0][:2])
    assert stop not in pol.decode(plain[1]) and stop not in pol.decode(plain[0][:1]), "pick other prompts"
    tools = Scripted(stop, "42")
    (c0, lp0, sampled0, _), (c1, lp1, sampled1, _) = greedy(pol, prompts, tools)
    reply = pol.tok("42", add_special_tokens=False)["input_ids"]
    head = plain[0][:2] + reply
    rest = greedy(pol, [prompts[0] + head])[0][0].tolist()[:10 - len(head)]
    assert c0.tolist() == head + rest and tools.asked[0] == stop
    assert sampled0.tolist() == [True, True] + [False] * len(reply) + [True] * len(rest)
    assert (lp0[~sampled0] == 0).all() and (lp0[sampled0] < 0).all()
    assert c1.tolist() == plain[1] and sampled1.all()


def test_no_reply_leaves_a_row_as_it_was_and_a_reply_past_the_budget_ends_it_at_its_call(tiny):  # noqa: F811
    pol = lively(policy(tiny, max_new_tokens=6))
    prompts = [pol.encode("1=")]
    plain = greedy(pol, prompts)[0]
    stop = pol.decode(plain[0][:2].tolist())
    none = greedy(pol, prompts, Scripted(stop, None))[0]               # out of calls: reply() says None
    assert none[0].tolist() == plain[0].tolist() and none[2].all() and none[3] == plain[3]
    c, lp, sampled, truncated = greedy(pol, prompts, Scripted(stop, "1234567"))[0]  # 2 + 7 ids > 6 allowed
    assert c.tolist() == plain[0][:2].tolist() and sampled.all() and truncated        # ends at its call


def as_batch(prompt, completion, sampled, reward=1.0):
    ids = torch.tensor(prompt + completion.tolist())
    rewards = torch.zeros(len(ids))
    rewards[-1] = reward
    mask = torch.cat([torch.zeros(len(prompt)), sampled.float()])
    return Trajectory(states=ids, actions=ids, logp=torch.zeros(len(ids)), rewards=rewards, mask=mask)


def test_a_reply_contributes_nothing_to_the_loss_or_the_gradient_whatever_its_logits(tiny):  # noqa: F811
    """One GRPO update (entropy bonus and KL on) with the logits that predict the reply's tokens replaced by
    noise: the same loss, the same metrics, the same weights after the step, bit for bit."""
    pol = lively(policy(tiny, max_new_tokens=10, lora_r=4))
    prompts = [pol.encode("1="), pol.encode("77 0 5 4=")]
    stop = pol.decode(greedy(pol, prompts[:1])[0][0][:2].tolist())
    samples = pol.act(prompts, 2, env=Scripted(stop, "42"))
    rows = [as_batch(prompts[i // 2], c, s, float(i % 2)) for i, (c, _, s, _) in enumerate(samples)]
    batch = Batch.from_rows(rows, 2)
    assert batch.insertions().sum() > 0, "no row called the tool: pick other prompts"
    adv = torch.tensor([-1.0, 1, -1, 1])[:, None] * batch.mask
    cfg = Config(task="maxdigit", model=tiny, lora=True, ent_coef=0.01, kl_coef=0.1, inner_epochs=2)

    prefix, noised = [], []                     # per forward: a prefix's (it passes logits_to_keep)?; noised

    def step(noise):
        torch.manual_seed(0)
        pol = lively(policy(tiny, max_new_tokens=10, lora_r=4))
        hook = pol.model.get_output_embeddings().register_forward_hook(noise) if noise else None
        which = pol.model.get_base_model().register_forward_pre_hook(
            lambda m, args, kw: prefix.append("logits_to_keep" in kw), with_kwargs=True)
        stats, _ = update(pol, Adam(list(pol.param_groups().values()), lr=1e-2), batch, adv, None, cfg, 10)
        which.remove()
        if hook:
            hook.remove()
        return stats, [p.detach().clone() for p in pol.param_groups()["actor"]]

    P = batch.mask.argmax(1)
    C = batch.mask.shape[1] - batch.mask.flip(1).argmax(1) - P                       # [N] completion spans
    buckets = itertools.cycle(_buckets(C.tolist()))   # each scoring forward takes the buckets of rows in turn

    def noise(module, inputs, logits):          # [b, S, V]: logits[k, j] predict bucket row k's token j
        if prefix[-1]:
            return logits                         # the shared prefix's forward (logits_to_keep=1)
        S, mask = logits.shape[1], torch.nn.functional.pad(batch.mask, (0, logits.shape[1]))
        reply = torch.stack([mask[i, P[i]:P[i] + S] for i in next(buckets)]) == 0       # [b, S]
        noised.append(int(reply.sum()))
        return logits + 1e4 * torch.randn_like(logits) * reply[..., None]

    (plain, w0), (noisy, w1) = step(None), step(noise)
    assert sum(noised) > 0
    assert plain == noisy and all(torch.equal(a, b) for a, b in zip(w0, w1))


def test_the_loss_on_a_completion_with_a_reply_by_hand():
    """logp [0, -1, (-9: a reply), -2], mask [0, 1, 0, 1] (prompt, sampled, reply, sampled), advantage 1,
    one epoch (ratio 1), token aggregation: loss = -(1 + 1) / 2 = -1 and d loss / d logp = [0, -1/2, 0, -1/2]:
    the reply's -9 is in neither the sum nor the count."""
    logp = torch.tensor([[0.0, -1, -9, -2]], requires_grad=True)
    mask = torch.tensor([[0.0, 1, 0, 1]])
    loss, ratio = policy_loss(logp, logp.detach(), torch.ones(1, 4), mask, 0.2, 0.2, "token", mask.sum())
    loss.backward()
    assert loss.item() == -1.0 and logp.grad.tolist() == [[0.0, -0.5, 0.0, -0.5]]
