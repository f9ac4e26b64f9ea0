"""Async transport on stdlib sockets: the trainer publishes weights and queues batches; workers lease, renew,
pull, submit. WireServer holds the bytes on the wire (safetensors and JSON, never a pickle), BatchQueue the
rules, TrainerServer answers. Invariant: a batch is queued only once every check passed (token, size, format,
dtypes, shapes, finite values, this run's limits, run id, version, lease); bad input just gets a 4xx."""
import asyncio
import bisect
import collections
import contextlib
import hmac
import json
import math
import os
import re
import secrets
import threading
import urllib.error
import urllib.request
from http import HTTPStatus
from http.client import HTTPException
from time import monotonic, sleep
from urllib.parse import parse_qsl

import safetensors.torch
import torch

from core import Batch

MAX_HEAD, MAX_CONNS, PER_WORKER = 16 << 10, 256, 2  # header bytes; unauthenticated connections; leases/worker
HEAD_S, LINGER_S = 5.0, 2.0                         # s for the headers; s an answered client may still send
STRANGER_LINGER = 1 << 16  # bytes read after answering one that never showed the token (a 403: heard whole)
CHUNK = 1 << 20                                     # bytes per write: what the socket refuses is copied
POLL_S = 0.02                                       # s between a waiting lease's looks for room


class Rejected(Exception):
    """An HTTP error answer: raised by the endpoints, and by the client when the trainer sends one."""

    def __init__(self, status, error, **extra):
        super().__init__(f"{status}: {error}")
        self.status, self.body = status, {"error": error, **extra}


class TrainerGone(ConnectionError):
    """The trainer stopped answering: the worker should exit cleanly."""


# ---- serialization: safetensors bytes, metadata in the header's string -> string map ----

def tensors_to_bytes(tensors, metadata=None):  # safetensors copies GPU tensors itself
    return safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()}, metadata)


def tensors_from_bytes(data):
    """-> (tensors, metadata). Malformed input of any kind raises ValueError; nothing is unpickled."""
    try:
        tensors = safetensors.torch.load(data)      # checks header length, offsets, sizes against the bytes
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    except Exception as e:                          # SafetensorError, JSON, unicode, recursion depth
        raise ValueError(f"body is not safetensors: {e}") from None
    return tensors, header.get("__metadata__") or {}


def describe(tensors):
    """{name: [shape, dtype]}: what trainer and worker compare (over JSON) before they work together."""
    return {k: [v.shape, str(v.dtype).removeprefix("torch.")] for k, v in tensors.items()}


def batch_to_bytes(batch, lease, run):
    return tensors_to_bytes({f: v for f, v in vars(batch).items() if torch.is_tensor(v)},
                            {"version": str(batch.version), "lease": lease, "run": run})


def wire_spec(limits, T):
    """{field: (dtype, shape)} of this run's batch of T steps: control rows ([N, T, O] states) bring the
    final_states [N, O] that PPO's critic bootstraps a truncated row from; token rows ([N, T] ids) none."""
    N, O, llm = limits["group_size"] * limits["n_prompts"], limits["obs_dim"], limits["prompt_len"] > 0
    spec = {"states": (torch.long, (N, T)) if llm else (torch.float32, (N, T, O)),
            "actions": (torch.long, (N, T)), "truncated": (torch.bool, (N,)),
            **dict.fromkeys(("logp", "rewards", "mask"), (torch.float32, (N, T)))}
    if not llm:
        spec["final_states"] = (torch.float32, (N, O))
    return spec


def batch_from_bytes(data, limits):
    """The one gate: bytes -> (a Batch this run could have produced, metadata), or a ValueError naming the
    defect. limits (train.batch_limits): anything else raised inside the loop (on CUDA, a device-side
    assert). prompt_len 0: a control task; max_len: completion tokens (control: steps); obs_dim 0: tokens."""
    tensors, meta = tensors_from_bytes(data)
    prompt_len, max_len, (low, high) = limits["prompt_len"], limits["max_len"], limits["reward"]
    llm, version = prompt_len > 0, meta.get("version", "")
    if not (version.isdecimal() and meta.get("lease") and meta.get("run")):
        raise ValueError(f"metadata needs a version, a lease and a run (POST /lease): {str(meta)[:300]}")
    states = tensors.get("states", torch.zeros(0))
    T = states.shape[1] if states.ndim > 1 else -1
    spec = wire_spec(limits, T)
    if set(tensors) != set(spec):
        raise ValueError(f"tensors {sorted(tensors)} are not this run's {sorted(spec)}: final_states [N, O] "
                         f"comes with [N, T, O] states (control), never with [N, T] token ids")
    for name, (dtype, shape) in spec.items():
        tensor = tensors[name]
        if tensor.dtype != dtype or tensor.shape != shape:
            raise ValueError(f"{name} {tensor.dtype} {list(tensor.shape)} is not this run's {dtype} "
                             f"{list(shape)}: this run takes {limits['n_prompts']} prompts x "
                             f"{limits['group_size']} samples")
        if not torch.isfinite(tensor).all():                            # ids and flags are always finite
            raise ValueError(f"NaN or inf in {name}")
    if not 0 < T <= prompt_len + max_len:
        raise ValueError(f"T {T} is not in 1..{prompt_len + max_len}: {prompt_len} prompt + {max_len} "
                         f"completion tokens" if llm else f"T {T} is not in 1..{max_len}: this task's steps")
    batch = Batch(**{"final_states": None, **tensors}, group_size=limits["group_size"], version=int(version),
                  lease=meta["lease"])
    mask, actions = batch.mask, batch.actions
    start, end = mask.argmax(1), T - mask.flip(1).argmax(1)   # [N]: [start, end) trained, for a 0/1 mask
    holes, n_actions = limits["insertions"], limits["n_actions"]
    rules = [   # (holds, what a worker's author reads when it does not), checked in this order
        (((mask == 0) | (mask == 1)).all(), "mask must be 0 or 1 everywhere"),
        (mask.any(1).all(), "every row's mask needs a 1 (a trained step)"),
        (start.min() >= llm and start.max() <= prompt_len,
         f"a row's 1s start after its prompt (1..{prompt_len} tokens)" if llm else "a row starts at step 0"),
        ((end - start).max() <= max_len, f"a row's 1s span at most {max_len} steps (the completion budget)"),
        (batch.insertions().max() <= holes, f"a row's runs of 0s between 1s are insertions: at most {holes} "
                                            f"(--max-tool-calls + --max-turns - 1)"),
        (actions.min() >= 0 and actions.max() < n_actions,
         f"{'token' if llm else 'action'} ids must be in [0, {n_actions})"),
        (not llm or torch.equal(actions, states), "token rows need actions equal states (both: the ids)")]
    for holds, message in rules:
        if not holds:
            raise ValueError(message)
    where = torch.arange(T) == (end - 1)[:, None] if llm else mask.bool()    # [N, T] where rewards may sit
    total = batch.rewards.sum(1)                                               # [N]
    if batch.rewards[~where].any() or total.min() < low - 1e-5 or total.max() > high + 1e-5:
        raise ValueError(f"rewards must sit on the {'last completion token' if llm else 'masked steps'} and "
                         f"total within this task's [{low:g}, {high:g}] per row")
    return batch, meta


# ---- the PEFT adapter as safetensors too, a uint8 tensor per file, only the two vLLM loads: a worker writes
# them into its folder, where an adapter_model.bin (a pickle) would be unpickled, another name be a path ----
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def pack_adapter(files):
    """The two ADAPTER_FILES out of what PEFT's save_pretrained wrote (it adds a README.md: left out)."""
    if missing := [n for n in ADAPTER_FILES if n not in files]:
        raise ValueError(f"adapter files {missing} missing from {sorted(files)[:5]}: save the adapter with "
                         f"PEFT's save_pretrained(dir, safe_serialization=True)")
    return tensors_to_bytes({n: torch.frombuffer(bytearray(files[n]), dtype=torch.uint8)
                             for n in ADAPTER_FILES})


def unpack_adapter(data, dest_dir):
    """Write the two ADAPTER_FILES into dest_dir; anything else, and nothing is written."""
    files = tensors_from_bytes(data)[0]
    if set(files) != set(ADAPTER_FILES) or any(t.dtype != torch.uint8 for t in files.values()):
        raise ValueError(f"refusing adapter files {str(sorted(files))[:200]}: only {list(ADAPTER_FILES)}, "
                         f"both, as uint8 (is the trainer running this NanoRL version?)")
    os.makedirs(dest_dir, exist_ok=True)
    for n, t in files.items():
        t.numpy().tofile(os.path.join(dest_dir, n))
    return dest_dir


# ---- the trainer's side ----

def host_copy(x):
    """The tensors in nested tuples, dicts, lists (weights, a state_dict) copied to the host. copy=True:
    .cpu() aliases a CPU parameter (the optimizer steps it); .cpu().clone() copied GPU ones twice."""
    if isinstance(x, (tuple, list)):
        return type(x)(host_copy(v) for v in x)
    if isinstance(x, dict):
        return {k: host_copy(v) for k, v in x.items()}
    return x.detach().to("cpu", copy=True) if torch.is_tensor(x) else x


class Snapshots(dict):
    """version -> trainable tensors, of the last k + 1 versions, on every trainer rank: step s trains on a
    batch sampled at s - k .. s, whose old log-probs need its exact weights; s + 1 is added after step s."""

    def __init__(self, max_staleness):
        self.keep = max_staleness + 1

    def add(self, version, tensors):
        self[version] = host_copy(tensors)
        while len(self) > self.keep:
            del self[min(self)]
        return self[version]


class WireServer:
    """The bytes on the wire, for routes {"METHOD /path": endpoint(query, body)} -> bytes, JSON, or a
    coroutine of either; raises Rejected, or ValueError for a 400; query[name] is '' if not sent. One asyncio
    loop (a thread) serves every connection, so no client holds a thread: headers within HEAD_S s, all of it
    within `timeout` s (else 408); token and size (max_body) checked on the headers, before a byte of the body
    is read. At most MAX_CONNS connections yet to show the token, the oldest closed (an honest client shows it
    in ms: a flood cuts no long-poll or download). Once `gone` is set, a request with the token gets a 410."""

    def __init__(self, token, routes, max_body, host, port, timeout):
        if not token:
            raise ValueError("the trainer server needs a shared token: set NANORL_TOKEN to the same random "
                             "string (python -c 'import secrets; print(secrets.token_hex(16))') everywhere")
        self.token, self.routes, self.max_body, self.timeout = token.encode(), routes, max_body, timeout
        self.host, self.port = host, port
        self.gone, self._thread = "", None          # gone: the 410's message once the run is over
        self._unknown = {}                          # the loop's, writer -> handler task: no token yet

    def start(self):
        """Listen (port 0: any free port, then self.port says which) and serve from a thread of its own."""
        self._loop = asyncio.new_event_loop()
        try:                                        # here, so that an error (a taken port) raises here
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._accept, self.host, self.port, limit=MAX_HEAD, backlog=128))
        except OSError as e:                        # asyncio's 20-line traceback, as one line
            raise ValueError(f"--serve-port {self.port}: cannot listen ({e.strerror}): if the port is taken, "
                             f"pick another, or 0 for any free port") from None
        self.port = self._server.sockets[0].getsockname()[1]
        # joined by stop(): a daemon thread still parsing a batch at exit aborts the trainer (SIGABRT)
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="trainer-server")
        self._thread.start()
        return self

    def stop(self):
        """Close the port and every connection: at once, whatever the clients are doing."""
        if self._thread:
            async def close():
                self._server.close()
                # again until none is left: a connection accepted just before starts its handler a few
                # turns later; 3.10/3.11's wait_for can swallow a cancel landing as its read completes
                while tasks := asyncio.all_tasks() - {asyncio.current_task()}:
                    for task in tasks:
                        task.cancel()
                    await asyncio.wait(tasks, timeout=0.1)
                for _ in range(2):  # then the done callbacks abort the sockets, which close a turn later
                    await asyncio.sleep(0)  # (turns, not a timed wait: on a GIL-starved loop one times out)
                self._loop.stop()
            asyncio.run_coroutine_threadsafe(close(), self._loop)
            self._thread.join()
            self._loop.close()
            self._thread = None

    def _accept(self, reader, writer):
        # one request, one answer, closed however the task ends, even cancelled before it began (stop, flood)
        def close(_):
            self._unknown.pop(writer, None)
            writer.transport.abort()
        task = self._unknown[writer] = asyncio.ensure_future(self._handle(reader, writer))
        task.add_done_callback(close)
        if len(self._unknown) > MAX_CONNS:
            self._unknown.pop(next(iter(self._unknown))).cancel()

    async def _handle(self, reader, writer):
        try:
            status, out = 200, await asyncio.wait_for(self._request(reader, writer), self.timeout)
        except Rejected as e:
            status, out = e.status, e.body
        except (ValueError, asyncio.IncompleteReadError) as e:  # bad input below the endpoint; a request cut
            status, out = 400, {"error": str(e)}
        except asyncio.TimeoutError:                # a trickler (asyncio.timeout() would save a task: 3.11+)
            status, out = 408, {"error": f"not in time: headers {HEAD_S:g} s, all of it {self.timeout:g} s"}
        except asyncio.LimitOverrunError:
            status, out = 431, {"error": f"request line + headers over {MAX_HEAD} bytes"}
        except OSError:                             # reset by the peer
            return
        except Exception as e:                      # a bug of ours: an answer still, never a dropped socket
            status, out = 500, {"error": f"internal error: {e!r}"}
        kind, body = (("application/octet-stream", out) if isinstance(out, bytes) else
                      ("application/json", json.dumps(out).encode()))
        with contextlib.suppress(OSError, asyncio.TimeoutError):      # a client gone, or stalled
            writer.write(f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {kind}\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
            await self._send(writer, body)          # not concatenated: weights can be GBs
            # FIN, then discard what the client still sends for LINGER_S: a close on unread input resets, and
            # the client loses the answer. A stranger: STRANGER_LINGER bytes, then held unread (reset at once,
            # 256 junk streams under the GIL cut CartPole's 16.8 steps/s to 1.4)
            writer.write_eof()
            left = STRANGER_LINGER if writer in self._unknown else math.inf
            until = monotonic() + LINGER_S
            while left > 0 and (got := await asyncio.wait_for(reader.read(min(left, 1 << 16)),
                                                              until - monotonic())):
                left -= len(got)
            if left <= 0:
                await asyncio.sleep(until - monotonic())

    async def _send(self, writer, data):
        """In CHUNKs (the transport copied a whole blob it could not send at once); cut only once stalled."""
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
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_S)
        request, *lines = head[:-4].decode("latin-1").split("\r\n")
        valid = re.fullmatch(r"(\S+) (\S+) HTTP/1\.\d", request)
        if not valid or not all(":" in line for line in lines):
            raise Rejected(400, f"not an HTTP/1.x request: {request[:100]!r}")
        method, target = valid.groups()
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        auth = headers.get("authorization", "")
        if not auth.startswith("Bearer "):
            raise Rejected(401, "missing 'Authorization: Bearer <NANORL_TOKEN>' header")
        if not hmac.compare_digest(auth[7:].encode(), self.token):
            raise Rejected(403, "wrong token: NANORL_TOKEN differs between trainer and worker")
        self._unknown.pop(writer, None)             # it showed the token
        if self.gone:
            raise Rejected(410, self.gone)
        path, _, query = target.partition("?")
        endpoint = self.routes.get(f"{method} {path}")
        if not endpoint:
            raise Rejected(404, f"no endpoint {method[:20]} {path[:100]}: use one of {sorted(self.routes)}")
        n = headers.get("content-length", "") if method == "POST" else "0"
        if not n.isdecimal() or int(n) > self.max_body:
            raise Rejected(413 if n.isdecimal() else 400 if n else 411, f"POST needs a Content-Length of at "
                           f"most {self.max_body} bytes (this run's largest batch), got {n!r}")
        out = endpoint(collections.defaultdict(str, parse_qsl(query)), await reader.readexactly(int(n)))
        return await out if asyncio.iscoroutine(out) else out


class BatchQueue:
    """The rules for batches in, no HTTP: leases, admission, the staleness queue, its counters (k =
    max_staleness, bps = batches_per_step; under the lock: the trainer's thread takes, the server's loop
    leases and queues). A worker leases before generating; the trainer takes bps batches per version, so a
    batch started now, behind every lease and queued batch, is used within k versions iff leases + queued
    < k * bps + (bps - taken at this version) <= the capacity (k + 1) * bps. Leases prove life: one silent
    for lease_timeout s, older than lease_life s, or whose batch can only arrive stale is gone."""

    def __init__(self, max_staleness, batches_per_step, lease_timeout, lease_life):
        self.version, self._taken = 0, 0            # the current version; batches taken at it
        self._step_s, self._published = 1.0, 0.0    # s per version (lead time; the 429's hint); last publish
        self._gen_s = math.inf                      # s from lease to batch, averaged: how far ahead to lease
        self._post_s, self._asked = 0.0, 0          # s the trainer works after a publish; version it asked at
        self.k, self.bps = max_staleness, batches_per_step
        self.capacity = (max_staleness + 1) * batches_per_step
        self.lease_timeout, self.lease_life = lease_timeout, lease_life
        self._queue = []                            # batches, lowest version first
        self._leases = {}                           # lease id -> [version, worker, alive until, granted at]
        self.counters = collections.Counter()       # name -> count: train.py logs them (QUEUE_COLUMNS)
        self._cv = threading.Condition()            # guards all of the above; an RLock inside, so put() nests

    def count(self, name, n=1):
        with self._cv:
            self.counters[name] += n

    def put(self, batch):
        """Queue a validated batch; when full, evict the stalest (counted) rather than refuse the new one: it
        is next to be dropped anyway. Leased submits never fill the queue: this is the net for put()."""
        with self._cv:
            if len(self._queue) >= self.capacity:
                self._queue.pop(0)
                self.count("evicted")
            # lowest version first: a slow worker's batch is not overtaken into staleness by newer ones
            bisect.insort(self._queue, batch, key=lambda b: b.version)
            self.count("received")
            self._cv.notify_all()

    def next_batches(self, n, current_version, timeout):
        """n usable batches, lowest version first; those with current_version - v > k are dropped and
        counted. TimeoutError after `timeout` s, with the usable ones taken so far put back in front."""
        out, deadline = [], monotonic() + timeout
        with self._cv:
            if self._asked != current_version:     # its first ask since the publish: how long did it work on?
                self._post_s = 0.8 * self._post_s + 0.2 * (monotonic() - self._published)
                self._asked = current_version
            while len(out) < n:
                while not self._ready(current_version):
                    if monotonic() >= deadline:
                        self._queue = sorted(out + self._queue, key=lambda b: b.version)
                        self._taken -= len(out)
                        raise TimeoutError(f"{len(out)}/{n} batches in {timeout} s: are workers running?")
                    self._cv.wait(min(0.25, deadline - monotonic()))  # wakes on submits; leases expire
                b = self._queue.pop(0)
                if current_version - b.version > self.k:       # sampled more than k versions ago
                    self.count("dropped_stale")
                    continue
                out.append(b)
                self._taken += 1
            self.count("used", n)
        return out

    def _ready(self, current_version):
        """A batch can be taken now, unless a live lease granted k versions ago is out: its batch is usable
        at this step or never, so wait for it (or for it to stop proving life: a dead worker)."""
        due = [v for v, *_ in self._live().values() if current_version - v >= self.k]
        return bool(self._queue) and not (due and self._queue[0].version > min(due))

    def _live(self):  # -> the leases, less (counted) each silent, too old or useless one: read them only so
        now = monotonic()
        for lid, (v, _, alive, granted) in list(self._leases.items()):
            if alive < now or now - granted > self.lease_life or self.version - v > self.k:
                del self._leases[lid]
                self.count("leases_expired")
        return self._leases

    def grant(self, worker):     # {lease: id, version}, or why there is none
        with self._cv:
            now = monotonic()
            held = sum(w == worker for _, w, *_ in self._live().values())
            # lease only as far ahead (versions, <= k) as a batch takes to make, less what the trainer's work
            # after a publish hides: a queue kept full makes every batch k stale, and async training collapses
            lead = (self._gen_s - self._post_s) / max(self._step_s, 1e-3)  # versions; none made yet: inf
            ahead = math.ceil(min(self.k, max(lead, 0)))
            if held >= PER_WORKER:
                return f"worker {worker} holds {held} leases"
            if self.version < 1:
                return "no weights published yet"
            if len(self._leases) + len(self._queue) >= (ahead + 1) * self.bps - self._taken:
                return "no room: a batch started now would wait, or be too stale"
            lid = secrets.token_hex(16)
            self._leases[lid] = [self.version, worker, now + self.lease_timeout, now]
            return {"lease": lid, "version": self.version}

    def _held(self, lid):  # -> its lease, or a 409
        if lid not in self._live():
            raise Rejected(409, "lease unknown, expired or used: its batch would be refused; lease again")
        return self._leases[lid]

    def renew(self, lid):
        with self._cv:
            self._held(lid)[2] = monotonic() + self.lease_timeout

    def accept(self, batch, lid):  # the lease is used up
        with self._cv:
            leased, *_, granted = self._held(lid)
            if not leased <= batch.version <= self.version:
                raise ValueError(f"batch version {batch.version} is outside [{leased}, {self.version}]: "
                                 f"its lease's version .. the current one")
            del self._leases[lid]
            made = monotonic() - granted
            self._gen_s = made if self._gen_s == math.inf else 0.8 * self._gen_s + 0.2 * made
            self.put(batch)


class TrainerServer(WireServer, BatchQueue):
    """The endpoints, on the trainer (rank 0). A random run id per start, in /info, leases and weights, must
    come back with a batch: a --resume republishes version numbers with other weights (409 wrong_run)."""

    def __init__(self, token, fingerprint, max_staleness, batches_per_step=1, host="0.0.0.0", port=0, *,
                 limits, lease_timeout=5.0, lease_life=600.0, timeout=30.0):
        spec = wire_spec(limits, limits["prompt_len"] + limits["max_len"])   # its largest batch + a header
        max_body = sum(math.prod(shape) * dtype.itemsize for dtype, shape in spec.values()) + (16 << 10)
        WireServer.__init__(self, token, {
            "GET /info": lambda q, b: {"version": self.version, "run": self.run, "limits": limits,
                                       "fingerprint": fingerprint, "names": self.names},
            "POST /lease": self._lease, "POST /renew": lambda q, b: self.renew(q["lease"]),
            "GET /weights": lambda q, b: self._blob(q, "weights"), "POST /batch": self._submit,
            "GET /adapter": lambda q, b: self._blob(q, "adapter")}, max_body, host, port, timeout)
        BatchQueue.__init__(self, max_staleness, batches_per_step, lease_timeout, lease_life)
        self.limits, self.run = limits, secrets.token_hex(8)
        self.names, self._blobs = {}, {}            # of this version: describe(tensors); "weights", "adapter"

    def finish(self, grace):
        """The run is over: 410s from now on (workers exit); returns in `grace` s, for renewals to hear it."""
        self.gone = f"run {self.run} finished: no more batches are needed, the worker can exit"
        sleep(grace)

    def publish(self, version, tensors, adapter_files=None):
        """Make `version` current: the trainable tensors serialized once (a copy), for every worker."""
        if version <= self.version:             # only this thread changes it
            raise ValueError(f"publish {version!r} after {self.version}: versions start at 1, only increase")
        blobs = {"weights": tensors_to_bytes(tensors)}
        if adapter_files:
            blobs["adapter"] = pack_adapter(adapter_files)
        with self._cv:
            now = monotonic()
            self._step_s, self._published = now - self._published if self.version else 1.0, now
            self.names, self._blobs, self.version, self._taken = describe(tensors), blobs, version, 0

    def _blob(self, query, name):  # of this run's current version: none needs another
        with self._cv:
            version, run = query["version"], query["run"]
            if run != self.run:
                raise Rejected(409, f"run {run[:40]!r} is over, now {self.run} (restarted): lease again")
            if version != str(self.version) or name not in self._blobs:
                raise Rejected(404, f"no {name} at version {version[:20]!r} (now {self.version}): ask /info")
            return self._blobs[name]

    async def _lease(self, query, body):
        """?wait=S: without room, wait up to S s (timeout / 2 at most): a 429 makes the worker sleep a step,
        which can run the queue dry. Room opens on the trainer's thread: poll it (and gone) every POLL_S s."""
        worker, wait = query["worker"], query["wait"]
        if not re.fullmatch(r"[A-Za-z0-9]{1,64}", worker):
            raise ValueError(f"POST /lease?worker=ID needs 1-64 letters and digits, got {worker[:80]!r}")
        wait_s = min(int(wait), self.timeout / 2) if wait.isdecimal() else 0
        until = monotonic() + wait_s
        while isinstance(lease := self.grant(worker), str):
            if monotonic() >= until:
                self.count("leases_refused")
                # one that waited its wait out asks again at once; else about a step from now
                hint = 0.0 if wait_s else min(max(self._step_s, 0.05), 60)
                raise Rejected(429, lease, retry_after=round(hint, 3))
            await asyncio.sleep(POLL_S)
            if self.gone:
                raise Rejected(410, self.gone)
        return {**lease, "run": self.run, "renew_s": self.lease_timeout / 5}

    def _submit(self, query, body):
        """400 (counted: refused) for a batch this run cannot use; 409: another run's, or a lease not held."""
        try:
            batch, meta = batch_from_bytes(body, self.limits)
            if meta["run"] != self.run:
                self.count("wrong_run")
                raise Rejected(409, f"run {meta['run'][:40]!r} is over, now {self.run}: lease again")
            self.accept(batch, meta["lease"])
        except ValueError:
            self.count("refused")
            raise


class TrainerClient:
    """Connection failures retry with capped exponential backoff, then raise TrainerGone (the worker exits);
    HTTP errors raise Rejected at once. A retried POST /batch that had landed gets 409 (single-use leases)."""

    def __init__(self, url, token, timeout=60.0, patience=15.0, backoff=0.5):
        self.url, self.timeout, self.patience, self.backoff = url.rstrip("/"), timeout, patience, backoff
        self.retry_after, self.renew_s = 0.0, 1.0   # s: until the next lease try; between heartbeats
        self.finished = ""                          # the trainer's 410, heard by the heartbeat: run over
        self.auth = {"Authorization": f"Bearer {token}"}
        self.worker = secrets.token_hex(8)          # this process, for the trainer's cap on leases per worker
        self._open = urllib.request.build_opener(urllib.request.ProxyHandler({})).open  # no proxy sees token

    def _call(self, method, path, body=None, patience=None):
        """-> the answer's bytes, or its JSON."""
        patience = self.patience if patience is None else patience
        deadline, delay = monotonic() + patience, 0.0
        while True:
            sleep(delay)
            delay = min(2 * delay + self.backoff, 8.0)                  # 0, 1, 3, 7, .. x backoff, capped
            try:
                with self._open(urllib.request.Request(self.url + path, body, self.auth, method=method),
                                timeout=self.timeout) as r:
                    data = r.read()
                    return json.loads(data) if r.headers["Content-Type"] == "application/json" else data
            except urllib.error.HTTPError as e:     # ours are JSON
                extra = json.loads(e.read()) if e.headers["Content-Type"] == "application/json" else {}
                raise Rejected(e.code, **{"error": e.reason, **extra}) from None
            except (OSError, HTTPException) as e:   # URLError is an OSError
                if self.finished:                   # closed after saying so: no patience to wait out
                    raise Rejected(410, self.finished) from None
                if monotonic() >= deadline:
                    raise TrainerGone(f"{self.url} silent for {patience:g} s ({e}): trainer gone") from None

    def info(self):
        return self._call("GET", "/info")

    def check(self, fingerprint, names):
        """Refuse to work for a trainer of other task/split settings or weights (names: describe(params))."""
        info, diff = self.info(), []
        for what, theirs, ours in (("setting", info["fingerprint"], fingerprint),
                                   ("weight", info["names"], names)):
            ours = json.loads(json.dumps(ours))     # tuples -> lists, as the trainer's side came over JSON
            diff += [f"{what} {k!r}: trainer {theirs.get(k)!r}, worker {ours.get(k)!r}"
                     for k in sorted({*theirs, *ours}) if theirs.get(k) != ours.get(k)]
        if diff:
            raise ValueError(f"trainer and worker differ, refusing to run: {'; '.join(diff)}")

    def weights(self, run, version):
        return tensors_from_bytes(self._call("GET", f"/weights?version={version}&run={run}"))[0]

    def adapter(self, run, version, dest_dir):
        return unpack_adapter(self._call("GET", f"/adapter?version={version}&run={run}"), dest_dir)

    def lease(self, wait=0):
        """(run, version, lease id) once there is room, within `wait` s; else None: retry in retry_after s."""
        try:
            out = self._call("POST", f"/lease?worker={self.worker}&wait={wait}", b"")
        except Rejected as e:
            if e.status != 429:
                raise
            self.retry_after = e.body["retry_after"]
            return None
        self.renew_s = out["renew_s"]
        return out["run"], out["version"], out["lease"]

    @contextlib.contextmanager
    def keep_alive(self, lease_id):
        """Renew the lease every renew_s s while the body runs: a dead worker's lease expires in seconds."""
        done = threading.Event()

        def beat():
            while not done.wait(self.renew_s):
                try:
                    self._call("POST", f"/renew?lease={lease_id}", b"", patience=0)
                except Rejected as e:               # expired or useless now: the submit will say so
                    if e.status == 410:
                        self.finished = e.body["error"]
                    return
                except TrainerGone:
                    pass                            # the main thread finds out on its next call
        threading.Thread(target=beat, daemon=True, name="lease-heartbeat").start()
        try:
            yield
        finally:
            done.set()

    def submit(self, batch, lease_id, run):
        return self._call("POST", "/batch", batch_to_bytes(batch, lease_id, run))
