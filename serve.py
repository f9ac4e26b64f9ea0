"""Async transport on stdlib HTTP: the trainer publishes weights and queues batches; workers lease, pull, submit.

Invariant: a batch is queued only after every check passed (token, size, format, dtypes, shapes, finite values,
version, lease), so bad input gets a 4xx and never touches what is queued. The wire carries safetensors and
JSON, never a pickle.
"""
import hmac
import io
import json
import os
import secrets
import tarfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from http.client import HTTPException
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import safetensors.torch
import torch

from core import Batch

# Batch field -> (dtype, rank) on the wire; states is [N, T] long or [N, T, O] float32, final_states [N, O] float32
FIELDS = {"actions": (torch.long, 2), "logp": (torch.float32, 2), "rewards": (torch.float32, 2),
          "mask": (torch.float32, 2), "truncated": (torch.bool, 1), "group_id": (torch.long, 1)}


class Rejected(Exception):
    """An HTTP error answer: raised by the server's endpoints, and by the client when the trainer sends one."""

    def __init__(self, status: int, reason: str, **extra):
        super().__init__(f"{status}: {reason}")
        self.status, self.body = status, {"error": reason, **extra}


class TrainerGone(ConnectionError):
    """The trainer stopped answering: the worker should exit cleanly."""


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


def batch_to_bytes(batch: Batch, lease: str) -> bytes:
    tensors = {f: getattr(batch, f) for f in ("states", *FIELDS, "final_states") if getattr(batch, f) is not None}
    meta = {"version": str(batch.version), "lease": lease, "group_size": str(batch.group_size),
            "final_states": str(int(batch.final_states is not None))}
    return tensors_to_bytes(tensors, meta)


def batch_from_bytes(data: bytes) -> tuple[Batch, dict]:
    """-> (Batch, metadata) after every check that needs no server state; each defect raises ValueError."""
    t, meta = tensors_from_bytes(data)
    version, G, final = (meta.get(k, "") for k in ("version", "group_size", "final_states"))
    if not (version.isascii() and version.removeprefix("-").isdigit() and G.isascii() and G.isdigit()
            and meta.get("lease") and final in ("0", "1")):
        raise ValueError(f"metadata needs int version and group_size, a lease (POST /lease) and final_states "
                         f"'0' or '1', got {str(meta)[:300]}")
    version, G, want = int(version), int(G), {"states", *FIELDS} | ({"final_states"} if final == "1" else set())
    if set(t) != want:
        raise ValueError(f"tensors {sorted(t)} are not the expected {sorted(want)}")
    s = t["states"]
    if not ((s.dtype == torch.long and s.ndim == 2) or (s.dtype == torch.float32 and s.ndim == 3)):
        raise ValueError(f"states must be [N, T] long or [N, T, O] float32, got {s.dtype} {list(s.shape)}")
    N, T = s.shape[:2]
    spec = {f: (dtype, (N, T) if rank == 2 else (N,)) for f, (dtype, rank) in FIELDS.items()}
    if final == "1":
        spec["final_states"] = (torch.float32, (N, s.shape[-1] if s.ndim == 3 else "O of [N, T, O] states"))
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


# ---- the PEFT adapter travels as a flat tar of plain files ----

def _plain(name: str) -> bool:
    return name not in ("", ".", "..") and os.path.basename(name) == name and "\\" not in name


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            if not _plain(name):
                raise ValueError(f"adapter file {name!r} must be a plain file name (no directories)")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def unpack_adapter(data: bytes, dest_dir: str) -> str:
    """Untar into dest_dir, refusing anything but plain regular files: no absolute paths, '..', dirs or links."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = tar.getmembers()
            if bad := [m.name for m in members if not (m.isfile() and _plain(m.name))]:
                raise ValueError(f"refusing adapter tar members {bad}: only plain file names")
            os.makedirs(dest_dir, exist_ok=True)
            tar.extractall(dest_dir, members=members, filter="data")   # tarfile's own checks on top of ours
    except tarfile.TarError as e:
        raise ValueError(f"adapter is not a valid tar: {e}") from None
    return dest_dir


# ---- the trainer's side ----

class Snapshots:
    """The trainable tensors of the last k + 2 versions, kept by every trainer rank: a batch sampled at
    version v is used by version v + k at the latest, and its old log-probs need v's exact weights."""

    def __init__(self, max_staleness: int):
        self.keep, self.by_version = max_staleness + 2, {}

    def add(self, version: int, tensors: dict) -> dict:
        # the clone is load-bearing: .cpu() of a CPU tensor aliases the live parameter, which the
        # optimizer then changes under the snapshot that old log-probs are recomputed with
        self.by_version[version] = {k: v.detach().cpu().clone() for k, v in tensors.items()}
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
    with none taken that is the queue capacity (k + 1) * bps. Otherwise 429 with a retry_after hint (the
    last step's duration). A lease is used once and expires after lease_timeout s (a dead worker's slot
    comes back), so only batches that bypass leases (put()) can still be dropped as stale.
    """

    def __init__(self, token: str, fingerprint: dict, max_staleness: int, batches_per_step: int = 1,
                 host: str = "0.0.0.0", port: int = 0, max_body: int = 1 << 30, lease_timeout: float = 600.0):
        if not token:
            raise ValueError("the trainer server needs a shared token: set NANORL_TOKEN to the same random string "
                             "(python -c 'import secrets; print(secrets.token_hex(16))') on every machine")
        self.token, self.fingerprint = token.encode(), json.loads(json.dumps(fingerprint))
        self.k, self.bps, self.max_body, self.lease_timeout = max_staleness, batches_per_step, max_body, lease_timeout
        self.capacity, self.host, self.port, self._httpd = (max_staleness + 1) * batches_per_step, host, port, None
        self.version, self.names, self._weights, self._adapter = 0, {}, None, None
        self._step_s, self._published = 1.0, 0.0    # seconds per version: the 429's retry_after hint
        self._queue, self._leases, self._taken = deque(), {}, {}
        self.counters = dict.fromkeys("received used dropped_stale dropped_no_snapshot evicted leases_refused "
                                      "leases_expired".split(), 0)
        self._cv = threading.Condition()            # guards all of the above; an RLock inside, so put() nests
        self.routes = {"/version": ("GET", lambda q, b: {"version": self.version}), "/info": ("GET", lambda q, b: {
                           "version": self.version, "fingerprint": self.fingerprint, "names": self.names}),
                       "/weights": ("GET", lambda q, b: self._blob(q, "_weights")),
                       "/adapter": ("GET", lambda q, b: self._blob(q, "_adapter")),
                       "/lease": ("POST", self._lease), "/batch": ("POST", self._submit)}

    def start(self) -> "TrainerServer":
        self._httpd = ThreadingHTTPServer((self.host, self.port), _Handler)
        # handler threads are joined by stop(): a daemon thread still parsing a batch into torch tensors
        # when the interpreter exits aborted the trainer (SIGABRT, "terminate called", seen under torchrun)
        self._httpd.daemon_threads, self._httpd.trainer, self.port = False, self, self._httpd.server_address[1]
        self._httpd.handle_error = lambda request, address: None   # a client hanging up is not the trainer's problem
        threading.Thread(target=self._httpd.serve_forever, args=(0.1,), daemon=True, name="trainer-server").start()
        return self

    def stop(self):
        if self._httpd:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def publish(self, version: int, tensors: dict, adapter_files: dict[str, bytes] | None = None):
        """Make `version` current: serialize the trainable tensors once (a copy: the bytes never alias
        the live parameters), for every worker that asks."""
        blob, tar = tensors_to_bytes(tensors), _tar(adapter_files) if adapter_files else None
        with self._cv:
            if not (isinstance(version, int) and version > max(self.version, 0)):
                raise ValueError(f"publish version {version!r}: versions start at 1 and only increase ({self.version})")
            now = time.monotonic()
            self._step_s, self._published, self._taken = now - self._published if self.version else 1.0, now, {}
            self.version, self.names, self._weights, self._adapter = version, describe(tensors), blob, tar
            self._cv.notify_all()

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
            while len(out) < n:
                while not self._ready(current_version) and time.monotonic() < deadline:
                    self._cv.wait(min(0.5, deadline - time.monotonic()))  # wakes on submits; leases expire by time
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
        """A batch can be taken now, unless a lease granted k versions ago is still out: its batch is
        usable at this step or never, so wait for it (or for the lease to expire: a dead worker)."""
        self._expire(time.monotonic())
        due = [v for v, _ in self._leases.values() if current_version - v >= self.k]
        return bool(self._queue) and not (due and min(q.version for q in self._queue) > min(due))

    # ---- endpoints: (query, body) -> dict (JSON) or (bytes, headers); Rejected or ValueError for a 4xx ----

    def authorize(self, header: str | None):
        if not header or not header.startswith("Bearer "):
            raise Rejected(401, "missing 'Authorization: Bearer <NANORL_TOKEN>' header")
        if not hmac.compare_digest(header[7:].encode(), self.token):
            raise Rejected(403, "wrong token: NANORL_TOKEN differs between trainer and worker")

    def _blob(self, query, attr: str):
        """Weights or adapter bytes of the current version: a worker never needs an older one."""
        with self._cv:
            raw, blob = query.get("version", [""])[0], getattr(self, attr)
            if not (raw.isascii() and raw.isdigit()):
                raise Rejected(400, f"version must be a non-negative int, got {raw!r}")
            if int(raw) != self.version or blob is None:
                raise Rejected(404, f"no {attr[1:]} at version {raw} (current {self.version}): ask /version again")
            return blob, {"X-Version": str(self.version)}

    def _expire(self, now: float):
        for lid in [lid for lid, (_, until) in self._leases.items() if until < now]:
            del self._leases[lid]
            self.counters["leases_expired"] += 1

    def _lease(self, query, body):
        with self._cv:
            now = time.monotonic()
            self._expire(now)
            room = self.k * self.bps + self.bps - self._taken.get(self.version, 0)
            if self.version < 1 or len(self._leases) + len(self._queue) >= room:
                self.counters["leases_refused"] += 1
                raise Rejected(429, "no room: a batch started now would arrive too stale" if self.version else
                               "no weights published yet", retry_after=round(min(max(self._step_s, 0.05), 60.0), 3))
            lid = secrets.token_hex(16)
            self._leases[lid] = (self.version, now + self.lease_timeout)
            return {"version": self.version, "lease": lid}

    def _submit(self, query, body):
        batch, meta = batch_from_bytes(body)        # the heavy checks, outside the lock
        with self._cv:
            self._expire(time.monotonic())
            lease = self._leases.get(meta["lease"])
            if not 1 <= batch.version <= self.version:
                raise Rejected(400, f"batch version {batch.version} is outside [1, {self.version}] (current)")
            if lease is None:
                raise Rejected(409, "lease unknown, expired or already used: ask POST /lease again")
            if batch.version < lease[0]:
                raise Rejected(400, f"batch sampled at version {batch.version}, before its lease's {lease[0]}")
            del self._leases[meta["lease"]]
            self.put(batch)
            return {"queued": len(self._queue)}


class _Handler(BaseHTTPRequestHandler):
    timeout = 60                                    # seconds a stalled client may hold its thread
    default_request_version = "HTTP/1.0"            # a garbled request line still gets a status line (0.9: none)

    def log_message(self, *args):
        pass                                        # a stderr line per request would drown the training log

    def __getattr__(self, name):                    # every verb lands here: 405 for PUT, FOO, ..., not a 501
        if name.startswith("do_"):
            return self._answer
        raise AttributeError(name)

    def _answer(self):
        ts, headers, ctype, self._body_read = self.server.trainer, {}, "application/json", False
        try:
            ts.authorize(self.headers.get("Authorization"))
            url = urlsplit(self.path)
            if url.path not in ts.routes:
                raise Rejected(404, f"no endpoint {url.path}: use one of {sorted(ts.routes)}")
            method, endpoint = ts.routes[url.path]
            if self.command != method:
                raise Rejected(405, f"{url.path} takes {method}, not {self.command}")
            out = endpoint(parse_qs(url.query), self._body(ts.max_body) if method == "POST" else b"")
            status, (body, headers) = 200, out if isinstance(out, tuple) else (json.dumps(out).encode(), {})
            ctype = "application/octet-stream" if isinstance(out, tuple) else ctype
        except Rejected as e:
            status, body = e.status, json.dumps(e.body).encode()
        except ValueError as e:                     # malformed input found below the endpoint
            status, body = 400, json.dumps({"error": str(e)}).encode()
        except Exception as e:                      # a bug of ours: still an answer, never a dropped connection
            status, body = 500, json.dumps({"error": f"internal error: {e!r}"}).encode()
        try:
            self.send_response(status)
            for k, v in {"Content-Type": ctype, "Content-Length": str(len(body)), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)
            # drain an unread body (up to 64 MiB, 2 s a read) so closing sends a FIN, not a reset that destroys
            # the answer: a 4 MB body refused with 403 reached urllib as 'connection reset' 20 times out of 20
            n = self.headers.get("Content-Length", "")
            n = 0 if self._body_read or not (n.isascii() and n.isdigit()) else min(int(n), 64 << 20)
            self.connection.settimeout(2.0)
            while n > 0 and (chunk := self.rfile.read1(min(n, 1 << 16))):
                n -= len(chunk)
        except OSError:
            pass

    def _body(self, max_body: int) -> bytes:
        n = self.headers.get("Content-Length")
        status = 411 if n is None else 400 if not (n.isascii() and n.isdigit()) else 413 if int(n) > max_body else 0
        if status:                                  # refused before a byte of the body is read
            raise Rejected(status, f"POST needs a Content-Length of at most {max_body} bytes, got {n!r}")
        try:
            body, self._body_read = self.rfile.read(int(n)), True
        except TimeoutError:
            raise Rejected(408, "body not received in time") from None
        if len(body) != int(n):
            raise Rejected(400, f"body has {len(body)} bytes, Content-Length says {n}")
        return body


# ---- the rollout worker's side ----

class TrainerClient:
    """Connection failures retry with capped exponential backoff, then raise TrainerGone (the worker exits);
    an HTTP error raises Rejected at once with the trainer's reason. A retried POST /batch whose first try
    did land gets 409: leases are single-use, so a batch is never queued twice."""

    def __init__(self, url: str, token: str, timeout: float = 60.0, patience: float = 15.0, backoff: float = 0.5):
        self.url, self.timeout, self.patience, self.backoff = url.rstrip("/"), timeout, patience, backoff
        self.auth, self.retry_after = {"Authorization": f"Bearer {token}"}, 0.0
        self._open = urllib.request.build_opener(urllib.request.ProxyHandler({})).open  # no http_proxy sees the token

    def _call(self, method: str, path: str, body: bytes | None = None) -> bytes:
        start, attempt = time.monotonic(), 0
        while attempt == 0 or time.monotonic() - start < self.patience:
            time.sleep(min(self.backoff * (2 ** attempt - 1), 8.0))     # 0, 1, 3, 7, .. x backoff, capped
            attempt += 1
            try:
                with self._open(urllib.request.Request(self.url + path, body, self.auth, method=method),
                                timeout=self.timeout) as r:
                    return r.read()
            except urllib.error.HTTPError as e:     # ours are JSON; http.server's own (e.g. 414) are HTML
                extra = json.loads(e.read()) if e.headers.get_content_type() == "application/json" else {}
                raise Rejected(e.code, str(extra.pop("error", e.reason)), **extra) from None
            except (urllib.error.URLError, OSError, HTTPException) as e:
                err = e
        raise TrainerGone(f"no answer from {self.url} for {self.patience:g} s ({err}): the trainer is gone")

    def version(self) -> int:
        return json.loads(self._call("GET", "/version"))["version"]

    def info(self) -> dict:
        return json.loads(self._call("GET", "/info"))

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

    def weights(self, version: int) -> dict:
        return tensors_from_bytes(self._call("GET", f"/weights?version={version}"))[0]

    def adapter(self, version: int, dest_dir: str) -> str:
        return unpack_adapter(self._call("GET", f"/adapter?version={version}"), dest_dir)

    def lease(self) -> tuple[int, str] | None:
        """(version, lease id), or None when the trainer has no room: wait self.retry_after s and ask again."""
        try:
            out = json.loads(self._call("POST", "/lease", b""))
        except Rejected as e:
            if e.status != 429:
                raise
            self.retry_after = e.body.get("retry_after", 1.0)
            return None
        return out["version"], out["lease"]

    def submit(self, batch: Batch, lease_id: str) -> dict:
        return json.loads(self._call("POST", "/batch", batch_to_bytes(batch, lease_id)))
