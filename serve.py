"""Async transport on stdlib sockets: the trainer publishes weights and queues batches; workers lease, renew, pull, submit.

Invariant: a batch is queued only after every check passed (token, size, format, dtypes, shapes, finite values,
this run's limits, run id, version, lease), so bad input gets a 4xx and never touches what is queued. The wire
carries safetensors and JSON, never a pickle; one event loop serves every connection, so no client holds it.
"""
import asyncio
import contextlib
import hmac
import json
import math
import os
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from http import HTTPStatus
from http.client import HTTPException
from urllib.parse import parse_qs, urlsplit

import safetensors.torch
import torch

from core import Batch

# Batch field -> (dtype, rank) on the wire; states is [N, T] long or [N, T, O] float32, final_states [N, O] float32
FIELDS = {"actions": (torch.long, 2), "logp": (torch.float32, 2), "rewards": (torch.float32, 2),
          "mask": (torch.float32, 2), "truncated": (torch.bool, 1), "group_id": (torch.long, 1)}
MAX_HEAD, MAX_CONNS, PER_WORKER = 16 << 10, 256, 2  # header bytes; unauthenticated connections; leases/worker
HEAD_S, LINGER_S = 5.0, 2.0                         # s for the headers; s an answered client may still send
CHUNK = 1 << 20                                     # bytes per write: what the socket refuses is copied


class Rejected(Exception):
    """An HTTP error answer: raised by the server's endpoints, and by the client when the trainer sends one."""

    def __init__(self, status: int, reason: str, **extra):
        super().__init__(f"{status}: {reason}")
        self.status, self.body = status, {"error": reason, **extra}


class TrainerGone(ConnectionError):
    """The trainer stopped answering: the worker should exit cleanly."""


class _Wait(Exception):  # no room for a lease yet: the request waits (a long poll) instead of getting a 429
    pass



# ---- serialization: safetensors bytes, metadata in the header's string -> string map ----

def tensors_to_bytes(tensors: dict, metadata: dict | None = None) -> bytes:
    return safetensors.torch.save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata)


def tensors_from_bytes(data: bytes) -> tuple[dict, dict]:
    """-> (tensors, metadata). Malformed input of any kind raises ValueError; nothing is unpickled."""
    try:
        tensors = safetensors.torch.load(data)      # checks header length, offsets and sizes against the bytes
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    except Exception as e:                          # SafetensorError, JSON, unicode, recursion depth
        raise ValueError(f"body is not safetensors: {e}") from None
    return tensors, header.get("__metadata__") or {}


def describe(tensors: dict) -> dict:
    """{name: [shape, dtype]}: what trainer and worker compare before they agree to work together."""
    return {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in tensors.items()}


def batch_to_bytes(batch: Batch, lease: str, run: str) -> bytes:
    tensors = {f: getattr(batch, f) for f in ("states", *FIELDS, "final_states") if getattr(batch, f) is not None}
    meta = {"version": str(batch.version), "lease": lease, "run": run, "group_size": str(batch.group_size)}
    return tensors_to_bytes(tensors, meta)


def batch_from_bytes(data: bytes) -> tuple[Batch, dict]:
    """-> (Batch, metadata) after every check that needs no server state; each defect raises ValueError."""
    t, meta = tensors_from_bytes(data)
    version, G = (meta.get(k, "") for k in ("version", "group_size"))
    if not (version.isascii() and version.removeprefix("-").isdigit() and G.isascii() and G.isdigit()
            and meta.get("lease") and meta.get("run")):
        raise ValueError(f"metadata needs int version and group_size, a lease and a run (POST /lease), got "
                         f"{str(meta)[:300]}")
    # control rows ([N, T, O] states) end somewhere: PPO's critic bootstraps a truncated row from there, and a
    # batch without final_states once killed a PPO trainer (TypeError); token rows have none
    control = "states" in t and t["states"].ndim == 3
    version, G, want = int(version), int(G), {"states", *FIELDS} | ({"final_states"} if control else set())
    if set(t) != want:
        raise ValueError(f"tensors {sorted(t)} are not the expected {sorted(want)}: final_states [N, O] "
                         f"comes with [N, T, O] states (control), never with [N, T] token ids")
    s = t["states"]
    if not ((s.dtype == torch.long and s.ndim == 2) or (s.dtype == torch.float32 and s.ndim == 3)):
        raise ValueError(f"states must be [N, T] long or [N, T, O] float32, got {s.dtype} {list(s.shape)}")
    N, T = s.shape[:2]
    spec = {f: (dtype, (N, T) if rank == 2 else (N,)) for f, (dtype, rank) in FIELDS.items()}
    if control:
        spec["final_states"] = (torch.float32, (N, s.shape[2]))
    for f, (dtype, shape) in spec.items():
        if t[f].dtype != dtype or tuple(t[f].shape) != shape:
            raise ValueError(f"{f} must be {dtype} {list(shape)}, got {t[f].dtype} {list(t[f].shape)}")
    if N < 1 or T < 1 or G < 1 or N % G:
        raise ValueError(f"need N >= 1 rows in whole groups and T >= 1, got N {N}, T {T}, group_size {G}")
    if not all(torch.isfinite(x).all() for x in t.values() if x.is_floating_point()):
        raise ValueError("NaN or inf in a float field")
    groups = torch.arange(N // G).repeat_interleave(G)                      # [N] 0, 0, .., 1, 1, ..
    if not (((t["mask"] == 0) | (t["mask"] == 1)).all() and torch.equal(t["group_id"], groups)):
        raise ValueError("mask must be 0/1 and group_id 0, 0, .., 1, 1, ..: each group's rows contiguous")
    return Batch(**{f: t[f] for f in ("states", *FIELDS)}, final_states=t.get("final_states"),
                 group_size=G, version=version), meta


def check_batch(b: Batch, limits: dict):
    """What this run can produce (train.batch_limits); anything else raised inside the loop (on CUDA, a
    device-side assert). prompt_len 0: a control task; max_len: completion tokens (control: steps)."""

    G, P, prompt, L, A = (limits[k] for k in ("group_size", "n_prompts", "prompt_len", "max_len", "n_actions"))
    (N, T), llm, (lo, hi) = b.mask.shape, prompt > 0, limits["reward"]
    if b.group_size != G or N != G * P:
        raise ValueError(f"{N} rows in groups of {b.group_size}: this run takes {P} prompts x {G} samples")
    if T > prompt + L:
        raise ValueError(f"T {T} is over this run's {prompt} prompt + {L} completion tokens" if llm else
                         f"T {T} is over this task's {L} steps")
    if llm != (b.states.ndim == 2) or (not llm and b.states.shape[2] != limits["obs_dim"]):
        raise ValueError(f"states {list(b.states.shape)} are not this run's: " + (
            "[N, T] token ids" if llm else f"[N, T, {limits['obs_dim']}] observations"))
    m, t = b.mask.bool(), torch.arange(T)
    start, n = m.int().argmax(1), m.sum(1)                                  # [N] first trained position, count
    if not (n.min() >= 1 and torch.equal(m, (t >= start[:, None]) & (t < (start + n)[:, None]))):
        raise ValueError("each row's mask must be one contiguous run of 1s, at least one long")
    if not (start.min() >= llm and start.max() <= prompt and n.max() <= L):      # control: from step 0
        raise ValueError(f"each row's mask must start after its prompt ({int(llm)}..{prompt} tokens) and cover <= {L}")
    if b.actions.min() < 0 or b.actions.max() >= A or (llm and not torch.equal(b.actions, b.states)):
        raise ValueError(f"token ids must be in [0, {A}) and actions equal states" if llm else
                         f"action ids must be in [0, {A})")
    where = torch.zeros_like(m).scatter_(1, (start + n - 1)[:, None], True) if llm else m   # an LLM row's last token
    R = b.rewards.sum(1)                                                    # [N]
    if (b.rewards[~where] != 0).any() or R.min() < lo - 1e-5 or R.max() > hi + 1e-5:
        raise ValueError("rewards must sit on the " + ("last completion token" if llm else "masked steps")
                         + f" and total within this task's [{lo:g}, {hi:g}] per row")


def max_batch_bytes(limits: dict) -> int:
    """The largest body a batch of this run can be: [N, T] fields at their wire dtypes, per-row fields, 16 KiB header."""
    N, T, O = limits["group_size"] * limits["n_prompts"], limits["prompt_len"] + limits["max_len"], limits["obs_dim"]
    return N * T * ((4 * O if O else 8) + 8 + 4 + 4 + 4) + N * (1 + 8 + 4 * O) + (16 << 10)


# ---- the PEFT adapter travels as safetensors too: one uint8 tensor per file ----

# what vLLM loads, and nothing else: workers write them into the folder it loads, where an adapter_model.bin
# (a pickle) would be unpickled; any other name could also be a path ('../x', '/etc/x')
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def pack_adapter(files: dict[str, bytes]) -> bytes:
    """The two ADAPTER_FILES out of what PEFT's save_pretrained wrote (it adds a README.md: left out)."""
    if missing := [n for n in ADAPTER_FILES if n not in files]:
        raise ValueError(f"adapter files {missing} missing from {sorted(files)[:5]}: save the adapter with "
                         f"PEFT's save_pretrained(dir, safe_serialization=True)")
    return tensors_to_bytes({n: torch.frombuffer(bytearray(files[n]), dtype=torch.uint8)
                             for n in ADAPTER_FILES})


def unpack_adapter(data: bytes, dest_dir: str) -> str:
    """Write the two ADAPTER_FILES into dest_dir; anything else, and nothing is written."""
    files = tensors_from_bytes(data)[0]
    bytes_1d = all(t.dtype == torch.uint8 and t.ndim == 1 for t in files.values())
    if set(files) != set(ADAPTER_FILES) or not bytes_1d:
        raise ValueError(f"refusing adapter files {str(sorted(files))[:200]}: only {list(ADAPTER_FILES)}, "
                         f"both, as 1-d uint8 (is the trainer running this NanoRL version?)")
    os.makedirs(dest_dir, exist_ok=True)
    for n, t in files.items():
        with open(os.path.join(dest_dir, n), "wb") as f:
            f.write(t.numpy().tobytes())
    return dest_dir


# ---- the trainer's side ----

class Snapshots:
    """The trainable tensors of the last k + 1 versions, kept by every trainer rank: step s trains on a batch
    sampled at version s - k .. s, whose old log-probs need its exact weights; s + 1 is added after step s."""

    def __init__(self, max_staleness: int):
        self.keep, self.by_version = max_staleness + 1, {}

    def add(self, version: int, tensors: dict) -> dict:
        # copy=True is load-bearing: .cpu() of a CPU tensor aliases the live parameter, which the optimizer
        # then changes under the snapshot; .cpu().clone() copied GPU tensors twice
        self.by_version[version] = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
        while len(self.by_version) > self.keep:
            del self.by_version[min(self.by_version)]
        return self.by_version[version]

    def get(self, version: int) -> dict | None:
        return self.by_version.get(version)


class TrainerServer:
    """Weights out, batches in, on the trainer (rank 0); k = max_staleness, bps = batches_per_step.

    Admission control: a worker leases a slot (POST /lease) before generating. The trainer takes bps
    batches per version, so a batch started now, behind every outstanding lease and queued batch, is used
    within k versions iff  leases + queued < k * bps + (bps - batches already taken at this version);
    with none taken that is the queue capacity (k + 1) * bps. Without room the request waits (?wait=S s)
    or gets a 429. Leases prove life: a lease not renewed (POST /renew) for lease_timeout s, older than
    lease_life s, or whose batch could only arrive stale is gone, and no step waits for it.

    Run identity: a random id per start, in /info, leases and weights; a batch must bring it back: a
    --resume republishes version numbers with other weights, so another run's batch gets 409 (wrong_run).

    One asyncio loop (a thread) serves every connection, so no client holds a thread: headers within HEAD_S s
    and the whole request within `timeout` s (else 408), checked on the headers before a byte of the body is
    read, at most this run's largest batch. Authentication comes first: at most MAX_CONNS connections yet to
    show the token (the oldest closed), and a connection that showed it is never closed for one that has not.
    An answer is cut only when the client took no byte of it for `timeout` s. finish(): 410 to everyone.
    """

    def __init__(self, token: str, fingerprint: dict, max_staleness: int, batches_per_step: int = 1,
                 host: str = "0.0.0.0", port: int = 0, *, limits: dict, lease_timeout: float = 5.0,
                 lease_life: float = 600.0, timeout: float = 30.0):
        if not token:
            raise ValueError("the trainer server needs a shared token: set NANORL_TOKEN to the same random string "
                             "(python -c 'import secrets; print(secrets.token_hex(16))') on every machine")
        self.token, self.fingerprint, self.run = token.encode(), json.loads(json.dumps(fingerprint)), secrets.token_hex(8)
        self.k, self.bps, self.limits, self.max_body = max_staleness, batches_per_step, limits, max_batch_bytes(limits)
        self.lease_timeout, self.lease_life, self.timeout = lease_timeout, lease_life, timeout
        self.capacity, self.host, self.port, self._thread = (max_staleness + 1) * batches_per_step, host, port, None
        self.version, self.names, self._weights, self._adapter = 0, {}, None, None
        self._step_s, self._published = 1.0, 0.0    # seconds per version: the 429's retry_after hint
        self._gen_s = None                          # seconds from lease to batch, averaged: how far ahead
        self._post_s, self._asked = 0.0, 0          # seconds the trainer works after a publish (evaluating)
        self._queue, self._leases, self._taken = deque(), {}, {}   # lease id -> [version, worker, alive until, until]
        self.counters = dict.fromkeys("received used dropped_stale dropped_no_snapshot evicted refused wrong_run "
                                      "leases_refused leases_expired".split(), 0)
        self._cv = threading.Condition()            # guards all of the above; an RLock inside, so put() nests
        self._finished = ""                         # set by finish(): every request then gets a 410 saying it
        self._conns, self._unknown = {}, {}         # the loop's, writer -> handler task: all; no token yet
        self.routes = {"/version": ("GET", lambda q, b: {"version": self.version, "run": self.run}),
                       "/info": ("GET", lambda q, b: {"version": self.version, "run": self.run, "limits": limits,
                                                      "fingerprint": self.fingerprint, "names": self.names}),
                       "/weights": ("GET", lambda q, b: self._blob(q, "_weights")),
                       "/adapter": ("GET", lambda q, b: self._blob(q, "_adapter")),
                       "/lease": ("POST", self._lease), "/renew": ("POST", self._renew), "/batch": ("POST", self._submit)}

    def start(self) -> "TrainerServer":
        self._loop = asyncio.new_event_loop()
        # joined by stop(): a thread still parsing a batch into torch tensors when the interpreter exits
        # aborted the trainer (SIGABRT, "terminate called", seen under torchrun)
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="trainer-server")
        self._thread.start()
        listen = asyncio.start_server(self._handle, self.host, self.port, limit=MAX_HEAD, backlog=128)
        self._room, self._server = asyncio.Event(), asyncio.run_coroutine_threadsafe(listen, self._loop).result()
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self):
        """Close the port and every connection: at once, whatever the clients are doing."""
        if self._thread:
            async def close():
                self._server.close()
                await asyncio.sleep(0.05)           # a connection accepted just before starts its handler a tick later:
                for task in list(self._conns.values()):  # unstarted, it would leave the client hanging on an open socket
                    task.cancel()
                await asyncio.gather(*self._conns.values(), return_exceptions=True)
            asyncio.run_coroutine_threadsafe(close(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            self._thread = None

    def finish(self, grace: float):
        """The run is over: every request with the token from now on, and every lease waiting, gets a 410, so
        workers exit instead of retrying a trainer that is gone. Returns after `grace` s, time for the
        workers' lease renewals (every lease_timeout / 5 s) to hear it; then stop()."""
        self._finished = f"run {self.run} finished: no more batches are needed, the worker can exit"
        self._wake()
        time.sleep(grace)

    def publish(self, version: int, tensors: dict, adapter_files: dict[str, bytes] | None = None):
        """Make `version` current: serialize the trainable tensors once (a copy: the bytes never alias
        the live parameters), for every worker that asks."""
        blob, tar = tensors_to_bytes(tensors), pack_adapter(adapter_files) if adapter_files else None
        with self._cv:
            if not (isinstance(version, int) and version > max(self.version, 0)):
                raise ValueError(f"publish version {version!r}: versions start at 1 and only increase ({self.version})")
            now = time.monotonic()
            self._step_s, self._published, self._taken = now - self._published if self.version else 1.0, now, {}
            self.version, self.names, self._weights, self._adapter = version, describe(tensors), blob, tar
            self._expire(now)                       # leases whose batch can only arrive stale now
            self._cv.notify_all()
        self._wake()                                # room for the leases waiting

    def count(self, name: str, n: int = 1):
        with self._cv:
            self.counters[name] += n

    def put(self, batch: Batch):
        """Queue a validated batch; when full, evict the OLDEST (counted) rather than refuse the new one: it is the
        stalest, next to be dropped anyway. Leased submits never fill the queue: this is the net for put()."""
        with self._cv:
            if len(self._queue) >= self.capacity:
                self._queue.popleft()
                self.counters["evicted"] += 1
            self._queue.append(batch)
            self.counters["received"] += 1
            self._cv.notify_all()

    def next_batches(self, n: int, current_version: int, timeout: float) -> list[Batch]:
        """n usable batches, oldest first; those with current_version - v > k are dropped and counted.
        TimeoutError after `timeout` s, with the usable ones taken so far put back in front."""
        out, deadline = [], time.monotonic() + timeout
        with self._cv:
            if self._asked != current_version:     # its first ask since the publish: how long did it work on?
                post = time.monotonic() - self._published
                self._post_s, self._asked = 0.8 * self._post_s + 0.2 * post, current_version
            while len(out) < n:
                while not self._ready(current_version) and time.monotonic() < deadline:
                    self._cv.wait(min(0.25, deadline - time.monotonic()))  # wakes on submits; leases expire by time
                if not self._ready(current_version):
                    self._queue.extendleft(reversed(out))
                    self._taken[current_version] = self._taken.get(current_version, 0) - len(out)
                    raise TimeoutError(f"{len(out)} of {n} usable batches after {timeout} s: are workers running?")
                i = min(range(len(self._queue)), key=lambda j: self._queue[j].version)
                b = self._queue[i]                  # oldest first: a slow worker's batch is not
                del self._queue[i]                  # overtaken into staleness by newer ones
                if current_version - b.version > self.k:       # sampled more than k versions ago
                    self.counters["dropped_stale"] += 1
                    continue
                out.append(b)
                self._taken[current_version] = self._taken.get(current_version, 0) + 1
            self.counters["used"] += n
        return out

    def _ready(self, current_version: int) -> bool:
        """A batch can be taken now, unless a live lease granted k versions ago is out: its batch is usable
        at this step or never, so wait for it (or for it to stop proving life: a dead worker)."""
        self._expire(time.monotonic())
        due = [v for v, *_ in self._leases.values() if current_version - v >= self.k]
        return bool(self._queue) and not (due and min(q.version for q in self._queue) > min(due))

    # ---- endpoints: (query, body) -> dict (JSON) or (bytes, headers); Rejected or ValueError for a 4xx ----

    def authorize(self, header: str | None):
        if not header or not header.startswith("Bearer "):
            raise Rejected(401, "missing 'Authorization: Bearer <NANORL_TOKEN>' header")
        if not hmac.compare_digest(header[7:].encode(), self.token):
            raise Rejected(403, "wrong token: NANORL_TOKEN differs between trainer and worker")

    def _blob(self, query, attr: str):
        """Weights or adapter bytes of the current version of this run: a worker never needs another."""
        with self._cv:
            raw, run, blob = query.get("version", [""])[0], query.get("run", [""])[0], getattr(self, attr)
            if not (raw.isascii() and raw.isdigit()):
                raise Rejected(400, f"version must be a non-negative int, got {raw!r}")
            if run != self.run:
                raise Rejected(409, f"run {run!r} is over: this trainer is run {self.run} (restarted?): lease again")
            if int(raw) != self.version or blob is None:
                raise Rejected(404, f"no {attr[1:]} at version {raw} (current {self.version}): ask /version again")
            return blob, {"X-Version": str(self.version), "X-Run": self.run}

    def _expire(self, now: float):
        for lid, (v, _, alive, until) in list(self._leases.items()):
            if alive < now or until < now or self.version - v > self.k:    # silent, too old, or useless
                del self._leases[lid]
                self.counters["leases_expired"] += 1
                self._wake()

    def _wake(self):
        if self._thread:                            # a fresh Event each time: the waiting leases ask again
            self._loop.call_soon_threadsafe(lambda: (self._room.set(), setattr(self, "_room", asyncio.Event())))

    def _lease(self, query, body):
        """?wait=S: without room, wait up to S s (timeout / 2 at most) for a slot, instead of a 429 that the
        worker slept a step on: the queue then ran dry every 4th step (5.5 steps/s; 7.2 polling every 10 ms)."""
        worker, wait = query.get("worker", [""])[0], query.get("wait", ["0"])[0]
        if not (worker.isascii() and worker.isalnum() and len(worker) <= 64):
            raise Rejected(400, f"POST /lease?worker=ID needs an ID of 1-64 letters and digits, got {worker[:80]!r}")
        with self._cv:
            now = time.monotonic()
            self._expire(now)
            # lease only as far ahead as a batch takes to make, beyond what the trainer's work after a publish
            # (evaluating) hides, in versions, k at most: a full queue made every batch k versions stale, and
            # async CartPole collapsed 1 run in 2
            lead = max((self._gen_s or 0.0) - self._post_s, 0.0)
            ahead = self.k if self._gen_s is None else min(self.k, math.ceil(lead / max(self._step_s, 1e-3)))
            room = ahead * self.bps + self.bps - self._taken.get(self.version, 0)
            held = sum(w == worker for _, w, *_ in self._leases.values())
            if self.version < 1 or len(self._leases) + len(self._queue) >= room or held >= PER_WORKER:
                if wait.isdigit() and int(wait) > 0 and held < PER_WORKER:
                    raise _Wait(min(int(wait), self.timeout / 2))
                self.counters["leases_refused"] += 1
                why = ("no weights published yet" if self.version < 1 else f"worker {worker} holds {held} leases"
                       if held >= PER_WORKER else "no room: a batch started now would wait, or be too stale")
                raise Rejected(429, why, retry_after=0.0 if wait == "over" else round(min(max(self._step_s, 0.05), 60), 3))
            lid = secrets.token_hex(16)
            self._leases[lid] = [self.version, worker, now + self.lease_timeout, now + self.lease_life]
            return {"run": self.run, "version": self.version, "lease": lid, "renew_s": self.lease_timeout / 5}

    def _renew(self, query, body):
        with self._cv:
            now = time.monotonic()
            self._expire(now)
            lease = self._leases.get(query.get("lease", [""])[0])
            if lease is None:
                raise Rejected(409, "lease unknown, expired or used: its batch would be refused")
            lease[2] = now + self.lease_timeout
            return {"run": self.run}

    def _submit(self, query, body):
        """400 (counted: refused) for a batch this run cannot use, 409 for another run's or a lease not held."""
        try:
            batch, meta = batch_from_bytes(body)    # the heavy checks, outside the lock
            check_batch(batch, self.limits)
            with self._cv:
                if meta["run"] != self.run:
                    self.counters["wrong_run"] += 1
                    raise Rejected(409, f"batch of run {meta['run'][:40]!r}, this is run {self.run} (restarted): lease again")
                if not 1 <= batch.version <= self.version:
                    raise ValueError(f"batch version {batch.version} is outside [1, {self.version}] (current)")
                self._expire(time.monotonic())
                lease = self._leases.get(meta["lease"])
                if lease is None:
                    raise Rejected(409, "lease unknown, expired or already used: ask POST /lease again")
                if batch.version < lease[0]:
                    raise ValueError(f"batch sampled at version {batch.version}, before its lease's {lease[0]}")
                del self._leases[meta["lease"]]
                made = time.monotonic() - (lease[3] - self.lease_life)      # since the lease was granted
                self._gen_s = made if self._gen_s is None else 0.8 * self._gen_s + 0.2 * made
                self.put(batch)
                return {"queued": len(self._queue)}
        except ValueError:
            self.count("refused")
            raise

    # ---- the event loop: a connection sends one request, gets one answer, and is closed ----

    async def _handle(self, reader, writer):
        # a connection is anyone's until it shows the token: those are capped among themselves (the oldest
        # goes; an honest one shows it in milliseconds): a flood never cuts a worker's long-poll or download
        self._conns[writer] = self._unknown[writer] = asyncio.current_task()
        if len(self._unknown) > MAX_CONNS:
            self._unknown.pop(next(iter(self._unknown))).cancel()
        extra, ctype = {}, "application/json"
        try:
            out = await asyncio.wait_for(self._request(reader, writer), self.timeout)
            status, (body, extra) = 200, out if isinstance(out, tuple) else (json.dumps(out).encode(), {})
            ctype = "application/octet-stream" if isinstance(out, tuple) else ctype
        except Rejected as e:
            status, body = e.status, json.dumps(e.body).encode()
        except ValueError as e:                     # malformed input found below the endpoint
            status, body = 400, json.dumps({"error": str(e)}).encode()
        except asyncio.TimeoutError:                # a trickler
            status, body = 408, json.dumps({"error": f"request not received in {self.timeout:g} s"}).encode()
        except (OSError, asyncio.CancelledError):   # reset by the peer, closed for a newer one, or stop()
            return self._close(writer)
        except Exception as e:                      # a bug of ours: still an answer, never a dropped connection
            status, body = 500, json.dumps({"error": f"internal error: {e!r}"}).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in {"Content-Type": ctype, "Content-Length": len(body),
                                                      "Connection": "close", **extra}.items())
        try:
            writer.write(f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n{head}\r\n".encode())
            await self._send(writer, body)          # not concatenated: weights can be GBs
            # FIN after the answer, then discard what the client still sends for LINGER_S: closing with unread
            # input sends a reset, which destroyed a 403 to a 4 MB body 20 times out of 20
            writer.write_eof()
            await asyncio.wait_for(self._discard(reader), LINGER_S)
        except (OSError, asyncio.TimeoutError, asyncio.CancelledError):
            pass
        self._close(writer)

    async def _send(self, writer, data: bytes):
        """In CHUNKs: the transport copied a whole blob it could not send at once. A client is cut only once
        it took no byte for `timeout` s: a 2 GB blob over a slow link arrives, however long it takes."""
        view = memoryview(data)
        for i in range(0, len(view), CHUNK):
            writer.write(view[i:i + CHUNK])
            while True:
                left = writer.transport.get_write_buffer_size()
                try:
                    await asyncio.wait_for(writer.drain(), self.timeout)
                    break
                except asyncio.TimeoutError:
                    if writer.transport.get_write_buffer_size() >= left:
                        raise                       # stalled: not a byte taken in `timeout` s

    async def _request(self, reader, writer):
        """Headers within HEAD_S s, then the body, then the endpoint. The token, path, method and
        Content-Length are checked on the headers, before a byte of the body is read."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_S)
            endpoint, query, n = self._head(head[:-4].decode("latin-1"))
            self._unknown.pop(writer, None)         # it showed the token
            body = await reader.readexactly(n)
        except asyncio.TimeoutError:                # (asyncio.timeout() would save a task, but needs 3.11)
            raise Rejected(408, f"request line + headers not received in {HEAD_S:g} s") from None
        except asyncio.LimitOverrunError:
            raise Rejected(431, f"request line + headers over {MAX_HEAD} bytes") from None
        except asyncio.IncompleteReadError as e:
            raise Rejected(400, f"request cut after {len(e.partial)} bytes (Content-Length, if any, says more)") from None
        until = None
        while True:
            room = self._room                       # set by publish() or an expiry: a slot may have opened
            if self._finished:
                raise Rejected(410, self._finished)
            try:
                return endpoint(query, body)
            except _Wait as e:                      # a lease waits for room: answered the moment there is some
                until = until or time.monotonic() + e.args[0]
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(room.wait(), min(0.5, until - time.monotonic()))
                query["wait"] = query["wait"] if time.monotonic() < until else ["over"]

    @staticmethod
    async def _discard(reader):
        while await reader.read(1 << 16):
            pass

    def _head(self, head: str):
        """Request line + headers -> (endpoint, query, body length); Rejected for anything else."""
        lines = head.split("\r\n")
        request, fields = lines[0].split(" "), [line.partition(":") for line in lines[1:]]
        if len(request) != 3 or not request[2].startswith("HTTP/1.") or not all(sep for _, sep, _ in fields):
            raise Rejected(400, f"not an HTTP/1.x request: {lines[0][:100]!r}")
        (method, target, _), headers = request, {k.strip().lower(): v.strip() for k, _, v in fields}
        self.authorize(headers.get("authorization"))
        url = urlsplit(target)
        if url.path not in self.routes:
            raise Rejected(404, f"no endpoint {url.path[:100]}: use one of {sorted(self.routes)}")
        want, endpoint = self.routes[url.path]
        if method != want:
            raise Rejected(405, f"{url.path} takes {want}, not {method[:20]}")
        n = headers.get("content-length") if want == "POST" else "0"
        if n is None or not (n.isascii() and n.isdigit()) or int(n) > self.max_body:
            raise Rejected(411 if n is None else 400 if not (n.isascii() and n.isdigit()) else 413,
                           f"POST needs a Content-Length of at most {self.max_body} bytes (this run's largest "
                           f"batch), got {n!r}")
        return endpoint, parse_qs(url.query), int(n)

    def _close(self, writer):
        self._conns.pop(writer, None)
        writer.transport.abort()


# ---- the rollout worker's side ----

class TrainerClient:
    """Connection failures retry with capped exponential backoff, then raise TrainerGone (the worker exits);
    an HTTP error raises Rejected at once with the trainer's reason. A retried POST /batch whose first try
    did land gets 409: leases are single-use, so a batch is never queued twice."""

    def __init__(self, url: str, token: str, timeout: float = 60.0, patience: float = 15.0, backoff: float = 0.5):
        self.url, self.timeout, self.patience, self.backoff = url.rstrip("/"), timeout, patience, backoff
        self.auth, self.retry_after, self.renew_s = {"Authorization": f"Bearer {token}"}, 0.0, 1.0
        self.finished = ""                          # the trainer's 410, heard by the heartbeat: run over
        self.worker = secrets.token_hex(8)          # this process, for the trainer's cap on leases per worker
        self._open = urllib.request.build_opener(urllib.request.ProxyHandler({})).open  # no http_proxy sees the token

    def _call(self, method: str, path: str, body: bytes | None = None, patience: float | None = None) -> bytes:
        start, attempt, patience = time.monotonic(), 0, self.patience if patience is None else patience
        while attempt == 0 or time.monotonic() - start < patience:
            time.sleep(min(self.backoff * (2 ** attempt - 1), 8.0))     # 0, 1, 3, 7, .. x backoff, capped
            attempt += 1
            try:
                with self._open(urllib.request.Request(self.url + path, body, self.auth, method=method),
                                timeout=self.timeout) as r:
                    return r.read()
            except urllib.error.HTTPError as e:     # ours are JSON
                extra = json.loads(e.read()) if e.headers.get_content_type() == "application/json" else {}
                raise Rejected(e.code, str(extra.pop("error", e.reason)), **extra) from None
            except (urllib.error.URLError, OSError, HTTPException) as e:
                if self.finished:                   # closed after saying so: no patience to wait out
                    raise Rejected(410, self.finished) from None
                err = e
        raise TrainerGone(f"no answer from {self.url} for {patience:g} s ({err}): the trainer is gone")

    def version(self) -> int:
        return json.loads(self._call("GET", "/version"))["version"]

    def info(self, patience: float | None = None) -> dict:
        return json.loads(self._call("GET", "/info", patience=patience))

    def check(self, fingerprint: dict, names: dict) -> dict:
        """Refuse to work for a trainer with other task/split settings or weights (names: describe(params))."""
        info, diff = self.info(), []
        for what, theirs, ours in (("setting", info["fingerprint"], fingerprint), ("weight", info["names"], names)):
            ours = json.loads(json.dumps(ours))     # tuples -> lists, as the trainer's side came over JSON
            diff += [f"{what} {k!r}: trainer {theirs.get(k)!r}, worker {ours.get(k)!r}"
                     for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)]
        if diff:
            raise ValueError("trainer and worker differ, refusing to run: " + "; ".join(diff))
        return info

    def weights(self, run: str, version: int) -> dict:
        return tensors_from_bytes(self._call("GET", f"/weights?version={version}&run={run}"))[0]

    def adapter(self, run: str, version: int, dest_dir: str) -> str:
        return unpack_adapter(self._call("GET", f"/adapter?version={version}&run={run}"), dest_dir)

    def lease(self, wait: int = 0) -> tuple[str, int, str] | None:
        """(run, version, lease id), as soon as the trainer has room within `wait` s; else None: wait
        self.retry_after s and ask again."""
        try:
            out = json.loads(self._call("POST", f"/lease?worker={self.worker}&wait={wait}", b""))
        except Rejected as e:
            if e.status != 429:
                raise
            self.retry_after = e.body.get("retry_after", 1.0)
            return None
        self.renew_s = out["renew_s"]
        return out["run"], out["version"], out["lease"]

    @contextlib.contextmanager
    def keep_alive(self, lease_id: str):
        """Renew the lease every renew_s s from a thread while the body runs (pull weights, generate, submit):
        a worker that dies or is killed stops renewing, and the trainer frees its slot within seconds."""
        done = threading.Event()

        def beat():
            while not done.wait(self.renew_s):
                try:
                    self._call("POST", f"/renew?lease={lease_id}", b"", patience=0)
                except Rejected as e:               # expired or useless now: the submit will say so
                    self.finished = e.body["error"] if e.status == 410 else self.finished
                    return
                except TrainerGone:
                    pass                            # the main thread finds out on its next call
        threading.Thread(target=beat, daemon=True, name="lease-heartbeat").start()
        try:
            yield
        finally:
            done.set()

    def submit(self, batch: Batch, lease_id: str, run: str) -> dict:
        return json.loads(self._call("POST", "/batch", batch_to_bytes(batch, lease_id, run)))
