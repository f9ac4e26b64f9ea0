"""Policies: MLPPolicy for control tasks, HFPolicy for LLMs (train + score + sample), the tiny test LM.

Protocol: act(...) samples without grad and returns the sampler's log-probs; logprobs(batch) ->
([N, T] log-probs under the current parameters, with grad; [N, T] entropy or None); value(states)
-> [N, T] or None. param_groups() -> {"actor": [...], "critic": [...]}, clipped separately.
"""
import copy
import inspect

import numpy as np
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def mlp(n_in, hidden, n_out):
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, n_out))


class MLPPolicy(nn.Module):
    """Categorical policy over n_actions; a separate critic trunk only when the algorithm needs one
    (sharing a trunk would let the critic's gradients move the policy)."""
    device = torch.device("cpu")

    def __init__(self, obs_dim, n_actions, hidden=64, critic=False, reference=False):
        super().__init__()
        self.actor = mlp(obs_dim, hidden, n_actions)
        self.critic = mlp(obs_dim, hidden, 1) if critic else None
        # KL reference: a frozen copy of the initial actor (a few KB for an MLP)
        self.ref = copy.deepcopy(self.actor).requires_grad_(False) if reference else None

    @torch.no_grad()
    def act(self, obs: np.ndarray, greedy=False):
        """obs [N, O] -> actions [N] int64, sampler log-probs [N] float32 (numpy, for the env)."""
        logp = torch.log_softmax(self.actor(torch.from_numpy(obs)), -1)      # [N, A]
        a = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1)[:, 0]  # [N]
        return a.numpy(), logp.gather(1, a[:, None])[:, 0].numpy()

    def logprobs(self, batch, entropy=False):
        logp_all = torch.log_softmax(self.actor(batch.states), -1)           # [N, T, A]
        logp = logp_all.gather(2, batch.actions[..., None])[..., 0]          # [N, T]
        ent = -(logp_all.exp() * logp_all).sum(-1) if entropy else None      # [N, T]
        return logp, ent

    @torch.no_grad()
    def ref_logprobs(self, batch):
        logp_all = torch.log_softmax(self.ref(batch.states), -1)             # [N, T, A]
        return logp_all.gather(2, batch.actions[..., None])[..., 0]          # [N, T]

    def value(self, states):
        return None if self.critic is None else self.critic(states)[..., 0]  # [N, T]

    def param_groups(self):
        groups = {"actor": list(self.actor.parameters())}
        if self.critic is not None:
            groups["critic"] = list(self.critic.parameters())
        return groups


class HFPolicy(nn.Module):
    """Any Hugging Face causal LM (hub id or local path), optionally with LoRA adapters (PEFT).

    Sampling draws from softmax(logits / temperature) and nothing else: the loop below never reads
    the model's generation_config (Qwen ships top_k=20 and a repetition penalty there; HF
    generate() would apply them silently and the loss would model the wrong distribution).
    Trainable weights are fp32; `dtype` is the autocast compute dtype (and the frozen base's
    storage dtype under LoRA, where bf16 is safe because it never receives updates).
    """

    def __init__(self, name, lora_r=0, lora_alpha=32, lora_targets="all-linear", dtype="float32",
                 temperature=1.0, max_new_tokens=256, gen_batch=64, grad_ckpt=False, thinking=False,
                 ref_copy=False):
        super().__init__()
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.dtype = getattr(torch, dtype)
        try:
            self.tok = AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=self.dtype if lora_r else torch.float32)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"--model {name}: could not load a causal LM ({type(e).__name__}: {str(e)[:300]}): "
                             f"pass a hub id or a directory saved with save_pretrained") from None
        # transformers 5.24 renamed forward's past_key_values (keyword and output field) to cache; vLLM pins
        # transformers < 5.21, so a worker next to it has the old name: read it off this model's own forward
        self.cache_key = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        if grad_ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lora = lora_r > 0
        if self.lora:
            from peft import LoraConfig, get_peft_model
            model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0,
                                                     target_modules=lora_targets))
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.float()             # bf16 adapters round AdamW's updates to zero
        self.model = model.to(self.device)
        self.ref = None                                 # full fine-tuning + KL: a frozen copy, if asked
        if ref_copy:
            print(f"warning: --ref-copy keeps a second copy of {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
                  f"parameters for the KL reference; --lora gets it for free", flush=True)
            self.ref = copy.deepcopy(model).requires_grad_(False).to(self.dtype)
        self.eos = stop_ids(self.tok, model.generation_config.eos_token_id)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos[0]
        self.temperature, self.max_new_tokens, self.gen_batch = temperature, max_new_tokens, gen_batch
        self.thinking = thinking

    def encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.tok, prompt, self.thinking)

    def decode(self, ids) -> str:
        return decode_ids(self.tok, ids)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    @torch.no_grad()
    def act(self, prompt_ids: list[list[int]], group_size: int, greedy=False):
        """group_size samples per prompt, prompt-major -> [(completion [C], sampler logp [C], truncated)]."""
        rows = [p for p in prompt_ids for _ in range(group_size)]
        return [s for i in range(0, len(rows), self.gen_batch) for s in self._generate(rows[i:i + self.gen_batch], greedy)]

    def _generate(self, rows, greedy):
        """KV-cached decoding of left-padded prompts; stops on every EOS id or at max_new_tokens."""
        B, P = len(rows), max(map(len, rows))
        ids = torch.tensor([[self.pad] * (P - len(r)) + r for r in rows], device=self.device)        # [B, P]
        attn = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows], device=self.device)  # [B, P]
        pos = (attn.cumsum(1) - 1).clamp(min=0)                                                      # [B, P]
        eos = torch.tensor(self.eos, device=self.device)
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        toks, logps, cache = [], [], None
        for _ in range(self.max_new_tokens):
            with self.autocast():
                out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                                 logits_to_keep=1, **{self.cache_key: cache})
            cache = out[self.cache_key]
            logp = torch.log_softmax(out.logits[:, -1].float() / self.temperature, -1)             # [B, V]
            nxt = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1)[:, 0]            # [B]
            toks.append(torch.where(done, self.pad, nxt))
            logps.append(logp.gather(1, nxt[:, None])[:, 0])
            done = done | torch.isin(nxt, eos)
            if done.all():
                break
            ids, pos = nxt[:, None], pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
        toks, logps = torch.stack(toks, 1).cpu(), torch.stack(logps, 1).float().cpu()             # [B, C]
        hit = torch.isin(toks, eos.cpu())
        length = torch.where(hit.any(1), hit.int().argmax(1) + 1, toks.shape[1])                    # stop token kept
        return [(toks[b, :n].clone(), logps[b, :n].clone(), not bool(hit[b].any())) for b, n in enumerate(length.tolist())]

    def logprobs(self, batch, entropy=False):
        return self._logprobs(self.model, batch, entropy)

    @torch.no_grad()
    def ref_logprobs(self, batch):
        if self.lora:                                   # the base model is the adapter switched off: no copy
            with self.model.disable_adapter():
                return self._logprobs(self.model, batch, False)[0]
        return self._logprobs(self.ref, batch, False)[0]

    def _logprobs(self, model, batch, entropy):
        """[mb, T] log p(id_t | id_<t) at the sampling temperature (0 where mask is 0), and entropy."""
        ids, mask = batch.states.to(self.device), batch.mask.to(self.device)                     # [mb, T]
        T = ids.shape[1]
        ends = T - mask.flip(1).argmax(1)                                                         # [mb] row lengths
        attn = (torch.arange(T, device=self.device)[None] < ends[:, None]).long()                 # [mb, T]
        start = int(mask.argmax(1).min())               # first completion token of any row
        with self.autocast():                           # logits only from position start-1 on
            logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=T - start + 1).logits  # [mb, K, V]: the memory peak
        logp, ent = torch.zeros_like(mask), torch.zeros_like(mask) if entropy else None
        for i in range(len(ids)):                       # one row's fp32 [K, V] at a time, recomputed in backward
            lp, e = checkpoint(_row_logprobs, logits[i, :-1], ids[i, start:], self.temperature, entropy,
                               use_reentrant=False)
            logp[i, start:] = lp
            if entropy:
                ent[i, start:] = e
        return logp * mask, (ent * mask if entropy else None)

    def value(self, states):
        return None

    def param_groups(self):
        return {"actor": [p for p in self.model.parameters() if p.requires_grad]}


def _row_logprobs(logits, targets, temperature, entropy):
    """[K, V] logits (any dtype), [K] targets -> [K] log-probs and [K] entropy (or None), in fp32."""
    lp = torch.log_softmax(logits.float() / temperature, -1)                                      # [K, V] fp32
    return lp.gather(1, targets[:, None])[:, 0], (-(lp.exp() * lp).sum(-1) if entropy else None)


def encode_prompt(tok, prompt: str, thinking: bool) -> list[int]:
    """The chat template when the tokenizer has one (thinking toggled for hybrid models), else plain text.
    Shared by HFPolicy and VLLMGenerator: trainer and worker must see the same prompt ids."""
    if tok.chat_template:
        return list(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True, enable_thinking=thinking)["input_ids"])
    return tok(prompt)["input_ids"]


def stop_ids(tok, generation_eos) -> list[int]:
    """Every EOS id the model declares: the tokenizer's and generation_config's (Qwen lists 2)."""
    listed = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    return sorted({tok.eos_token_id, *listed} - {None})


def decode_ids(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def vllm_samples(outputs, eos_ids) -> list[tuple]:
    """vLLM RequestOutputs (one per prompt, its n samples together) -> HFPolicy.act's list, prompt-major:
    (completion [C] with the stop token kept, sampler log-probs [C], truncated).

    vLLM keeps the stop token in token_ids (only .text drops it) and returns its log-prob, so it is
    there exactly once, last. truncated is "no stop token", as in HFPolicy: older vLLM checked the
    length limit before the stop tokens, so a stop token drawn as the last allowed token said "length"."""
    samples = []
    for request in outputs:
        for out in request.outputs:
            ids = list(out.token_ids)
            stopped = bool(ids) and ids[-1] in eos_ids
            assert stopped or out.finish_reason == "length", f"vLLM finished on {out.finish_reason}/{out.stop_reason}"
            logp = [pos[t].logprob for pos, t in zip(out.logprobs, ids, strict=True)]  # {token id: Logprob}
            samples.append((torch.tensor(ids, dtype=torch.long), torch.tensor(logp, dtype=torch.float32), not stopped))
    return samples


class VLLMGenerator:
    """Rollout-only LLM policy on vLLM (encode, decode and act as HFPolicy's; no gradients): the frozen
    base serves the trainer's LoRA adapter, one PEFT directory per version, so only the adapter travels.

    Sampling is softmax(logits / temperature) and nothing else: top_p=1 and top_k=0 (off), and the
    model's generation_config is not read. The log-probs are taken after temperature
    (processed_logprobs): vLLM's default raw_logprobs come before it and made a first-token ratio of
    2.0 at T=0.6. They only feed the logged logp_gap; the trainer recomputes old_logp itself.
    """
    RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)   # the max_lora_rank values vLLM accepts

    def __init__(self, name, lora_r, max_staleness, temperature=1.0, max_new_tokens=256, dtype="bfloat16",
                 gpu_memory_utilization=0.85, max_model_len=4096, seed=0, thinking=False):
        if lora_r not in self.RANKS:
            raise ValueError(f"--lora-r {lora_r} is not a rank vLLM serves: use one of {', '.join(map(str, self.RANKS))}")
        try:
            from vllm import LLM
        except ImportError:
            raise ValueError("--vllm needs vLLM on a CUDA machine: pip install vllm") from None
        from transformers import AutoTokenizer, GenerationConfig
        self.tok = AutoTokenizer.from_pretrained(name)
        try:
            gen_eos = GenerationConfig.from_pretrained(name).eos_token_id
        except OSError:                                 # no generation_config.json: the tokenizer's EOS alone
            gen_eos = None
        self.eos = stop_ids(self.tok, gen_eos)
        self.temperature, self.max_new_tokens, self.thinking, self.lora = temperature, max_new_tokens, thinking, None
        self.llm = LLM(model=name, dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len, enable_lora=True, max_lora_rank=lora_r,
                       max_loras=max_staleness + 1,     # every adapter version still in flight
                       logprobs_mode="processed_logprobs", max_logprobs=1, generation_config="vllm")

    def encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.tok, prompt, self.thinking)

    def decode(self, ids) -> str:
        return decode_ids(self.tok, ids)

    def load_adapter(self, version: int, path: str):
        """Serve `version`'s adapter (a PEFT directory) from now on. vLLM caches adapters by name, so
        every version gets its own; lora_int_id 0 is reserved, and versions start at 1."""
        from vllm.lora.request import LoRARequest
        assert version >= 1, version
        self.lora = LoRARequest(lora_name=f"nanorl-v{version}", lora_int_id=version, lora_path=path)

    def act(self, prompt_ids: list[list[int]], group_size: int, greedy=False):
        """group_size samples per prompt, prompt-major -> [(completion [C], sampler logp [C], truncated)].
        vLLM refuses n > 1 when greedy (eval only, its log-probs unused): the prompt is repeated instead."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        n, copies = (1, group_size) if greedy else (group_size, 1)
        params = SamplingParams(n=n, temperature=0.0 if greedy else self.temperature, top_p=1.0, top_k=0,
                                max_tokens=self.max_new_tokens,  # the default is 16
                                logprobs=0, stop_token_ids=self.eos, seed=None)  # logprobs=0: the sampled token's
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids for _ in range(copies)]
        return vllm_samples(self.llm.generate(prompts, params, lora_request=self.lora, use_tqdm=False), self.eos)


def make_tiny_lm(path, chars="0123456789 =,", layers=2, hidden=64, seed=0):
    """A character-level tokenizer and a few-layer Llama-architecture LM with random weights, saved
    with save_pretrained so it loads through the same --model PATH code as an 8B model. Llama,
    because AutoTokenizer reloads a Qwen2 config's tokenizer as Qwen2Tokenizer, whose own
    pre-tokenizer silently drops spaces and newlines (seen with transformers 5.x)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast
    specials = ["<|pad|>", "<|endoftext|>", "<|unk|>"]
    vocab = {c: i for i, c in enumerate(specials + list(dict.fromkeys(chars)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character a token
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|endoftext|>",
                            unk_token="<|unk|>").save_pretrained(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config = GenerationConfig(eos_token_id=1, pad_token_id=0)
    model.save_pretrained(path)
    return path


if __name__ == "__main__":  # python model.py runs/tiny-lm: build the tiny model the CPU LLM rung trains
    import sys
    print("saved", make_tiny_lm(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny-lm"))
