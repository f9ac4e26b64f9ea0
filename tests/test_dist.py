"""Data parallelism: 2 gloo ranks, each with half the prompts, give the gradient of one process."""
import contextlib
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

import algos
from test_train import ROOT, grads_after
from train import Config
from model import MLPPolicy
from tasks import CartPole

HP = {"ppo": dict(gamma=0.99, lam=0.95), "grpo": dict(std_norm=True)}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SKIPPING = ("grpo", "token")    # no entropy bonus, micro-batches of 1: rank 1's 4 rows (advantage 0) skipped


def problem(algo, agg):
    torch.manual_seed(0)
    skipping = (algo, agg) == SKIPPING
    cfg = Config(algo=algo, group_size=2, loss_agg=agg, max_grad_norm=0.0, ent_coef=0.0 if skipping else 0.01,
                 micro_batch=int(skipping))
    policy = MLPPolicy(4, 2, 16, critic=algo == "ppo")
    batch = CartPole().rollout(policy, [1, 2, 3, 4], group_size=2)        # 8 rows, uneven lengths
    return cfg, policy, batch


def rank_grads(rank, algo, agg, out):
    cfg, policy, batch = problem(algo, agg)
    half = batch[rank * 4:(rank + 1) * 4]                                 # this rank's 2 prompts
    half.group_size = 2
    adv, target = algos.ESTIMATORS[algo](half, policy, **HP[algo])       # ppo whitens over both ranks
    if (algo, agg) == SKIPPING and rank == 1:
        adv = torch.zeros_like(adv)                                       # as if both its groups were equal
    grads, stats = grads_after(policy, cfg, half, adv, target)
    torch.save((grads, stats), out + f".{rank}")


COMBOS = [("ppo", "token"), ("grpo", "seq"), ("grpo", "constant"), SKIPPING]


def ranks_main(rank, ports, tiny, out):
    """Every 2-rank check of this file in one spawn (each starts two interpreters that import torch: seconds):
    in init_distributed's group, a 3-step run of train() as torchrun's ranks run it, its stdout kept, and the
    gradients of COMBOS (and of the tiny LM); then, in a group keyed by device, the collectives and the
    sharded evaluations (collectives_rank_main)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]), RANK=str(rank), WORLD_SIZE="2")
    from train import train
    from utils import init_distributed
    with open(f"{out}-dp.stdout.{rank}", "w") as f, contextlib.redirect_stdout(f):
        assert init_distributed() == (rank, 2)
        train(Config(steps=3, n_prompts=4, out=f"{out}-dp", solve_at=0.0))
    for algo, agg in COMBOS:
        rank_grads(rank, algo, agg, f"{out}-{algo}-{agg}")
    if tiny:
        llm_rank_grads(rank, tiny, f"{out}-llm")
    torch.distributed.barrier()                         # nobody tears gloo down under a peer (SIGABRT)
    torch.distributed.destroy_process_group()
    collectives_rank_main(rank, ports[1], tiny, f"{out}-c")


def spawn_ranks(tmp, tiny):
    out = str(tmp / "r")
    mp.start_processes(ranks_main, args=((free_port(), free_port()), tiny, out), nprocs=2, start_method="spawn")
    return out, tiny


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Spawns ranks_main on 2 ranks once, MLPs only -> (the prefix of the files it saved, None)."""
    return spawn_ranks(tmp_path_factory.mktemp("two-ranks"), None)


@pytest.fixture(scope="module")
def two_ranks_llm(tmp_path_factory):
    """The same with the tiny LM too (its interpreters then import transformers and peft: the slow tier)."""
    pytest.importorskip("transformers", reason="the LLM path needs: pip install -r requirements-llm.txt")
    from model import make_tiny_lm
    tmp = tmp_path_factory.mktemp("two-ranks-llm")
    return spawn_ranks(tmp, make_tiny_lm(str(tmp / "tiny")))


@pytest.mark.parametrize("algo,agg", COMBOS)
def test_two_gloo_ranks_equal_one_process(two_ranks, algo, agg):
    """Also where rank 1 computes no row (SKIPPING): it still joins every collective (the stop's agreement at
    each micro-batch, the gradient all-reduce with zeros), and the gradient is rank 0's rows' alone."""
    cfg, policy, batch = problem(algo, agg)
    adv, target = algos.ESTIMATORS[algo](batch, policy, **HP[algo])
    if (algo, agg) == SKIPPING:
        adv[4:] = 0
    one, one_stats = grads_after(policy, cfg, batch, adv, target)
    for rank in range(2):
        two, stats = torch.load(f"{two_ranks[0]}-{algo}-{agg}.{rank}")
        assert stats["rows_trained"] == one_stats["rows_trained"] == (4 if (algo, agg) == SKIPPING else 8)
        for a, b in zip(one, two, strict=True):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), (a - b).abs().max()


def test_two_ranks_train_once_on_screen_and_on_disk(two_ranks):
    """test_torchrun_two_ranks_end_to_end without torchrun (its three interpreters: the slow tier): train() on
    2 gloo ranks, as torchrun's ranks run it. Rank 0 logs and writes, once; rank 1 says nothing."""
    out = two_ranks[0] + "-dp"
    said = [open(f"{out}.stdout.{rank}").read() for rank in range(2)]
    assert said[0].count("step 3/3 ") == 1 and said[1] == "", said                # rank 0 logs, once per step
    assert said[0].count("torch.distributed: gloo, the policy on the CPU (an MLP policy)") == 1   # rank 0, once
    assert len(open(out + ".csv").read().splitlines()) == 1 + 1 + 3               # header, step-0 eval, 3 steps


@pytest.mark.slow
def test_torchrun_two_ranks_end_to_end(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(free_port()),
           "train.py", "--steps", "3", "--n-prompts", "4", "--out", str(tmp_path / "dp"), "--solve-at", "0"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.count("step 3/3 ") == 1                                # rank 0 logs, once per step
    assert p.stdout.count("torch.distributed: gloo, the policy on the CPU (an MLP policy)") == 1   # rank 0, once
    assert len((tmp_path / "dp.csv").read_text().splitlines()) == 1 + 1 + 3       # header, step-0 eval, 3 steps


def llm_rank_grads(rank, tiny, out):
    cfg, policy, batch, adv = llm_problem(tiny)
    grads, _ = grads_after(policy, cfg, batch[rank * 4:(rank + 1) * 4], adv[rank * 4:(rank + 1) * 4], None, 4)
    torch.save(grads, out + f".{rank}")


def llm_problem(tiny):
    from model import HFPolicy
    from test_llm import as_batch
    torch.manual_seed(0)
    policy = HFPolicy(tiny, max_new_tokens=4, lora_r=4)
    torch.manual_seed(1)
    prompts = [policy.encode(p) for p in ("1 2 3=", "45=", "0=", "9 9 9 9=")]
    batch = as_batch(prompts, policy.act(prompts, 2), 2)
    adv = (torch.arange(8.0)[:, None] - 3.5) * batch.mask
    cfg = Config(task="maxdigit", model=tiny, algo="grpo", group_size=2, loss_agg="seq", lora=True, max_grad_norm=0.0)
    return cfg, policy, batch, adv


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process_on_the_tiny_lm(two_ranks_llm):
    out, tiny = two_ranks_llm
    cfg, policy, batch, adv = llm_problem(tiny)
    one, _ = grads_after(policy, cfg, batch, adv, None, 4)
    for rank in range(2):
        for a, b in zip(one, torch.load(f"{out}-llm.{rank}"), strict=True):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-4), (a - b).abs().max()


def collectives_rank_main(rank, port, tiny, out):
    """Every collective the loop uses, in a group keyed by device as on GPUs (there cpu:gloo,cuda:nccl:
    an NCCL-only group cannot reduce the CPU tensors of all_sum or scatter_object_list), and the
    sharded held-out evaluation. The NCCL half needs a GPU even to initialize (tried here with torch
    2.14.1's CUDA build: "ProcessGroupNCCL is only supported with GPUs"), so CPU tensors take the gloo
    half of 'cpu:gloo', exactly as they do in 'cpu:gloo,cuda:nccl'."""
    os.environ.update(MASTER_PORT=str(port))
    from tasks import MaxDigit
    from utils import all_reduce_grads, all_sum, broadcast_params, init_distributed
    init_distributed(timeout=60, backend="cpu:gloo")
    p = torch.nn.Parameter(torch.full((3,), float(rank + 1)))
    p.grad = torch.full((3,), float(rank + 1))
    all_reduce_grads([p])
    broadcast_params([p])                                                 # rank 0's 1.0 everywhere
    got = [None]
    torch.distributed.scatter_object_list(got, [{"r": 0}, {"r": 1}] if rank == 0 else None, src=0)
    res = {"backend": torch.distributed.get_backend(), "sum": all_sum(rank + 1.0), "grad": p.grad.tolist(),
           "param": p.data.tolist(), "object": got[0]}
    torch.manual_seed(0)
    res["cartpole"] = CartPole(eval_episodes=5).evaluate(Counting(MLPPolicy(4, 2, 16)), rank, 2)
    res["rows"] = Counting.rows
    if tiny:
        from model import HFPolicy
        torch.manual_seed(0)
        res["maxdigit"] = MaxDigit(eval_episodes=9, max_new_tokens=1).evaluate(HFPolicy(tiny, max_new_tokens=1), rank, 2)
    torch.save(res, out + f".{rank}")
    torch.distributed.barrier()                         # nobody tears gloo down under a peer (SIGABRT)
    torch.distributed.destroy_process_group()


class Counting(torch.nn.Module):
    """MLPPolicy that counts the rows it acts on: a rank must evaluate only its share."""
    rows = 0

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def act(self, obs, greedy=False):
        Counting.rows = max(Counting.rows, len(obs))
        return self.policy.act(obs, greedy)


@pytest.mark.parametrize("ranks", ["two_ranks", pytest.param("two_ranks_llm", marks=pytest.mark.slow)])
def test_collectives_and_a_sharded_evaluation_on_two_ranks(ranks, request):
    out, tiny = request.getfixturevalue(ranks)
    out += "-c"
    torch.manual_seed(0)
    one = CartPole(eval_episodes=5).evaluate(MLPPolicy(4, 2, 16))
    for rank in range(2):
        r = torch.load(out + f".{rank}")
        assert r["backend"] == "cpu:gloo"
        assert r["sum"] == 3.0 and r["grad"] == [3.0] * 3 and r["param"] == [1.0] * 3 and r["object"] == {"r": rank}
        assert r["cartpole"] == one and r["rows"] == (3, 2)[rank]       # 5 seeds: 3 on rank 0, 2 on rank 1
        if tiny:
            from model import HFPolicy
            from tasks import MaxDigit
            torch.manual_seed(0)
            alone = MaxDigit(eval_episodes=9, max_new_tokens=1).evaluate(HFPolicy(tiny, max_new_tokens=1))
            assert r["maxdigit"].pop("samples") == alone.pop("samples")[rank::2]   # each rank's own share
            assert r["maxdigit"] == alone



def test_the_process_group_outlasts_the_batch_timeout(monkeypatch):
    """Ranks > 0 wait in scatter_object_list as long as rank 0 waits for a worker batch: a group timeout
    at NCCL's default 600 s equal to --batch-timeout 600 killed them."""
    import train
    import utils
    seen = {}

    def fake_init(backend, timeout):                                  # records what train() asks for, then stops
        seen.update(backend=backend, timeout=timeout.total_seconds())
        raise KeyError("stop here")

    monkeypatch.setattr(utils.dist, "init_process_group", fake_init)
    monkeypatch.setattr(utils.dist, "is_initialized", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(KeyError, match="stop here"):
        train.train(Config(batch_timeout=900.0))
    assert seen == {"backend": "gloo", "timeout": 1500.0}


def test_cuda_only_for_an_llm_with_a_gpu_per_local_rank():
    from utils import device_for
    assert device_for(True, 1, 1) == "cuda" and device_for(True, 8, 8) == "cuda" and device_for(True, 8, 2) == "cuda"
    assert device_for(True, 1, 2) == "cpu"              # 2 ranks, 1 GPU: set_device(1) was "invalid device ordinal"
    assert device_for(True, 0, 1) == "cpu"              # no GPU
    assert device_for(False, 8, 1) == "cpu"             # an MLP control policy always runs on the CPU


@pytest.mark.parametrize("gpus,llm,backend,gpu_set", [(1, True, "gloo", None), (2, True, "cpu:gloo,cuda:nccl", 1),
                                                      (2, False, "gloo", None)])
def test_torchrun_with_more_ranks_than_gpus_falls_back_to_gloo_on_cpu(monkeypatch, capsys, gpus, llm, backend,
                                                                       gpu_set):
    """Rank 1 of `torchrun --nproc_per_node=2` on a machine with `gpus` GPUs. Test double: the GPU count and
    set_device are faked (no GPU here); init_process_group records its backend and stops train()."""
    import train
    import utils
    seen = {"gpu": None}

    def fake_init(backend, timeout):
        seen["backend"] = backend
        raise KeyError("stop here")

    monkeypatch.setattr(utils.dist, "init_process_group", fake_init)
    monkeypatch.setattr(utils.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.update(gpu=getattr(d, "index", d)))
    for k, v in dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", RANK="1", LOCAL_RANK="1").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(KeyError, match="stop here"):
        train.train(Config(task="maxdigit" if llm else "cartpole", model="unused"))
    assert seen == {"backend": backend, "gpu": gpu_set}
    assert capsys.readouterr().out == ""                # rank 1 says nothing; rank 0 says it once (torchrun test)
