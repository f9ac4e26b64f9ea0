"""The async transport against a real server on 127.0.0.1: round trips, staleness, leases, and hostile input."""
import asyncio
import contextlib
import http.client
import json
import os
import pickle
import socket
import time
from dataclasses import replace

import pytest
import torch

from core import Batch
from serve import (MAX_HEAD, STRANGER_LINGER, Rejected, Snapshots, TrainerClient, TrainerGone, TrainerServer,
                   batch_from_bytes, batch_to_bytes, describe, tensors_from_bytes, tensors_to_bytes, unpack_adapter)

TOKEN = "test-token-0123456789"
FP = {"task": "cartpole", "split_seed": 0}
# what the run can produce (train.batch_limits): control rows of <= 5 steps; LLM rows of a 1..3-token prompt and
# 1..4 completion tokens over a vocabulary of 50, reward in [0, 1.1]
LIMITS = {"group_size": 2, "n_prompts": 2, "prompt_len": 0, "max_len": 5, "n_actions": 2, "obs_dim": 4, "reward": [0, 5],
          "insertions": 0}
LLM_LIMITS = {**LIMITS, "prompt_len": 3, "max_len": 4, "n_actions": 50, "obs_dim": 0, "reward": [0, 1.1]}


def make_batch(version=1, N=4, G=2, T=5, llm=False, seed=0, V=50):
    """A batch a run of LIMITS (LLM_LIMITS; vocabulary V) could have sampled: random lengths, padding exactly 0."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(1, 3, (N,), generator=g) if llm else torch.zeros(N, dtype=torch.long)  # prompt lengths
    end = torch.stack([torch.randint(int(s) + 1, T + 1, (), generator=g) for s in start])         # [N]
    t = torch.arange(T)
    mask = ((t >= start[:, None]) & (t < end[:, None])).float()                                   # [N, T]
    if llm:
        states, rewards = torch.randint(0, V, (N, T), generator=g) * (t < end[:, None]), torch.zeros(N, T)
        rewards[torch.arange(N), end - 1] = torch.randint(0, 2, (N,), generator=g).float()       # 0 or 1
    else:
        states, rewards = torch.randn(N, T, 4, generator=g) * mask[..., None], mask.clone()
    return Batch(states=states, actions=states.clone() if llm else torch.randint(0, 2, (N, T), generator=g) * mask.long(),
                 logp=-torch.rand(N, T, generator=g) * mask, rewards=rewards, mask=mask,
                 truncated=torch.rand(N, generator=g) > 0.5,
                 final_states=None if llm else torch.randn(N, 4, generator=g), group_size=G, version=version)


def submit(client, batch):
    run, _, lease = client.lease()
    return client.submit(batch, lease, run)


def same_batch(a, b):
    fields = ("states", "actions", "logp", "rewards", "mask", "truncated", "final_states")
    return (a.group_size, a.version) == (b.group_size, b.version) and all(
        (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y))
        for x, y in ((getattr(a, f), getattr(b, f)) for f in fields))


@pytest.fixture
def serve(request):
    """serve(**kw) -> (server, client) on 127.0.0.1:<free port>, weights v1 published; stopped after the test."""
    servers = []

    def make(max_staleness=2, batches_per_step=1, publish=True, limits=LIMITS, **kw):
        s = TrainerServer(TOKEN, FP, max_staleness, batches_per_step, host="127.0.0.1", port=0, limits=limits,
                          **kw).start()
        servers.append(s)
        if publish:
            s.publish(1, {"w": torch.zeros(3)})
        return s, TrainerClient(f"http://127.0.0.1:{s.port}", TOKEN, timeout=5, patience=0.05, backoff=0.01)
    yield make
    for s in servers:
        s.stop()


def test_tensor_and_batch_round_trips_bit_for_bit():
    t = {"f32": torch.randn(3, 5), "bf16": torch.randn(4).bfloat16(), "i64": torch.arange(6).view(2, 3),
         "bool": torch.tensor([True, False]), "nonc": torch.randn(3, 4).t()}          # a transposed view, too
    back, meta = tensors_from_bytes(tensors_to_bytes(t, {"k": "v"}))
    assert meta == {"k": "v"} and set(back) == set(t)
    assert all(back[k].dtype == t[k].dtype and torch.equal(back[k], t[k]) for k in t)
    for b, limits in ((make_batch(), LIMITS), (make_batch(llm=True), LLM_LIMITS)):   # [N, T, 4] with final_states;
        got, meta = batch_from_bytes(batch_to_bytes(b, "L1", "R1"), limits)          # [N, T] long without
        assert same_batch(got, b) and (meta["lease"], meta["run"]) == ("L1", "R1")


def test_publish_version_weights_and_the_cpu_alias(serve):
    server, client = serve(publish=False)
    live = torch.zeros(3)
    server.publish(1, {"w": live, "b": torch.ones(2, 2)})
    live.add_(7)                                                    # the optimizer steps in place after publishing
    assert client.info()["version"] == 1
    got = client.weights(server.run, 1)
    assert torch.equal(got["w"], torch.zeros(3))
    assert client.info()["names"] == {"w": [[3], "float32"], "b": [[2, 2], "float32"]}
    server.publish(2, {"w": live, "b": torch.ones(2, 2)})
    with pytest.raises(Rejected) as e:                              # only the current version is served
        client.weights(server.run, 1)
    assert e.value.status == 404
    assert torch.equal(client.weights(server.run, 2)["w"], torch.full((3,), 7.0))
    with pytest.raises(Rejected) as e:                              # weights go only to a worker of this run
        client.weights("an-earlier-run", 2)
    assert e.value.status == 409
    with pytest.raises(ValueError, match="only increase"):
        server.publish(2, {"w": live})


def test_adapter_round_trip(serve, tmp_path):
    server, client = serve()
    files = {"adapter_config.json": b'{"r": 8}',
             "adapter_model.safetensors": tensors_to_bytes({"a": torch.ones(2)})}
    readme = {"README.md": b"# model card"}                         # PEFT's save_pretrained writes it too
    server.publish(2, {"w": torch.zeros(3)}, adapter_files={**files, **readme})
    out = client.adapter(server.run, 2, str(tmp_path / "v2"))
    assert {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)} == files   # no README.md
    pickled = {"adapter_config.json": b"{}", "adapter_model.bin": b"x"}
    with pytest.raises(ValueError, match="adapter_model.safetensors"):                    # never sent
        server.publish(3, {"w": torch.zeros(3)}, adapter_files=pickled)


def test_an_adapter_with_any_other_file_is_refused_and_nothing_written(tmp_path):
    """vLLM would unpickle an adapter_model.bin: a worker writes exactly the two files vLLM needs, or none."""
    good = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"safetensors bytes"}
    for files in ({**good, "adapter_model.bin": b"a pickle"}, {**good, "README.md": b"#"},
                  {"adapter_config.json": b"{}", "adapter_model.bin": b"x"}, {"adapter_config.json": b"{}"}):
        blob = tensors_to_bytes({n: torch.frombuffer(bytearray(d), dtype=torch.uint8)
                                 for n, d in files.items()})
        with pytest.raises(ValueError, match="refusing adapter files"):
            unpack_adapter(blob, str(tmp_path / "v"))
        assert not os.path.exists(tmp_path / "v")


def test_staleness_arithmetic_by_hand(serve):
    # k = 2, 2 batches per step: capacity (2 + 1) * 2 = 6, so five batches fit without eviction.
    server, _ = serve(max_staleness=2, batches_per_step=2)
    assert server.capacity == 6
    for v in range(1, 6):
        server.put(make_batch(version=v))
    # current 5: v1 (5-1 = 4 > 2) and v2 (5-2 = 3 > 2) are dropped; v3 (2 <= 2) and v4 (1) are used; v5 stays
    got = server.next_batches(2, current_version=5, timeout=1)
    assert [b.version for b in got] == [3, 4]
    assert server.counters["dropped_stale"] == 2 and server.counters["used"] == 2 and len(server._queue) == 1
    server.count("dropped_no_snapshot")
    assert server.counters["dropped_no_snapshot"] == 1


def test_queue_capacity_evicts_the_oldest(serve):
    server, _ = serve(max_staleness=1, batches_per_step=1)          # capacity (1 + 1) * 1 = 2
    for seed in range(3):
        server.put(make_batch(seed=seed))
    assert server.counters == {**server.counters, "received": 3, "evicted": 1}
    got = server.next_batches(2, 1, timeout=1)
    assert same_batch(got[0], make_batch(seed=1)) and same_batch(got[1], make_batch(seed=2))


def test_snapshots_keep_exactly_the_last_k_plus_1_versions_and_never_alias():
    # step s trains on a batch of version s - k .. s; version s + 1 is added only after that step
    snaps, live = Snapshots(max_staleness=2), torch.zeros(3)
    for v in range(1, 8):
        live.fill_(v)                                               # the optimizer steps in place
        snaps.add(v, {"w": live})
    assert [v for v in range(1, 8) if snaps.get(v) is not None] == [5, 6, 7]   # k + 1 = 3
    assert snaps.get(5)["w"].tolist() == [5.0, 5.0, 5.0]


def test_next_batches_timeout_keeps_what_it_took(serve):
    server, _ = serve()
    with pytest.raises(TimeoutError):
        server.next_batches(1, 1, timeout=0.1)
    server.put(make_batch(seed=3))
    with pytest.raises(TimeoutError):
        server.next_batches(2, 1, timeout=0.1)                      # one of two: put back, not lost
    assert same_batch(server.next_batches(1, 1, timeout=1)[0], make_batch(seed=3))
    assert server.counters["used"] == 1


def test_leases_capacity_single_use_and_expiry(serve):
    # lease_timeout 1 s: lease b outlives the next requests (ms each) on a loaded machine too
    server, client = serve(max_staleness=1, batches_per_step=1, lease_timeout=1.0)   # room (1 + 1) * 1 = 2
    (run, v1, a), (_, v2, b) = client.lease(), client.lease()
    assert v1 == v2 == 1 and client.lease() is None and client.retry_after > 0
    client.submit(make_batch(), a, run)
    with pytest.raises(Rejected) as e:                              # a lease is used once
        client.submit(make_batch(), a, run)
    assert e.value.status == 409
    with pytest.raises(Rejected) as e:
        client.submit(make_batch(), "never-granted", run)
    assert e.value.status == 409
    with pytest.raises(Rejected) as e:
        client.submit(make_batch(), "", run)
    assert e.value.status == 400
    assert client.lease() is None                                   # 1 queued + lease b = 2: full
    time.sleep(1.1)                                                 # b expires: its slot comes back
    assert client.lease() is not None and server.counters["leases_expired"] == 1
    with pytest.raises(Rejected) as e:
        client.submit(make_batch(), b, run)
    assert e.value.status == 409


def test_lease_refused_when_the_batch_would_arrive_stale(serve):
    # k = 0: the trainer took its batch for version 1, so a batch started now at v1 would be used at v2
    # (staleness 1 > 0): room = 0 * 1 + (1 - 1 taken) = 0. Publishing v2 reopens room = 1.
    server, client = serve(max_staleness=0)
    submit(client, make_batch())
    assert server.next_batches(1, 1, timeout=1)
    assert client.lease() is None
    server.publish(2, {"w": torch.zeros(3)})
    assert client.lease()[1] == 2 and client.lease() is None


def test_a_lease_goes_only_as_far_ahead_as_its_batch_takes_to_make(serve):
    """k = 2, one batch per step. room = ahead + 1 - taken, ahead = ceil((gen_s - post_s) / step_s) <= k, with
    the server's averages gen_s (lease to batch), step_s (between publishes) and post_s (publish to the
    trainer's next ask: its evaluation hides that much generation). Set here by hand to check the arithmetic."""
    server, client = serve(max_staleness=2)
    leases = lambda: [client.lease() for _ in range(3)]                          # the 4th is a 429 anyway
    server._step_s, server._post_s = 0.1, 0.05
    server._gen_s = 0.04                # hidden by the evaluation: ceil(0 / 0.1) = 0 ahead, room 1: fresh batches
    assert [x is not None for x in leases()] == [True, False, False]
    server._leases.clear()
    server._gen_s = 0.2                 # ceil(0.15 / 0.1) = 2 ahead, room 3: both of a worker's leases
    assert [x is not None for x in leases()] == [True, True, False]                  # (PER_WORKER = 2)
    server._leases.clear()
    server._gen_s = 1.0                 # ceil(9.5) = 10, but never over k = 2 versions: room 3
    assert sum(x is not None for x in leases()) == 2
    client.worker = "other"                                                           # a 2nd worker: the 3rd
    assert client.lease() is not None and client.lease() is None


def test_check_names_what_differs(serve):
    server, client = serve()
    client.check(dict(FP), describe({"w": torch.zeros(3)}))
    with pytest.raises(ValueError, match="split_seed"):
        client.check({**FP, "split_seed": 1}, describe({"w": torch.zeros(3)}))
    with pytest.raises(ValueError, match="'w'"):
        client.check(FP, describe({"w": torch.zeros(4)}))


def test_empty_token_and_gone_trainer(serve):
    with pytest.raises(ValueError, match="NANORL_TOKEN"):
        TrainerServer("", FP, 2, limits=LIMITS)
    server, client = serve()                                        # the client: 2 tries, 0.01 s backoff
    assert client.info()["version"] == 1
    server.stop()
    t0 = time.time()
    with pytest.raises(TrainerGone, match="Connection refused"):   # refused at once: no socket timeout waited
        client.info()["version"]
    # within its 0.05 s patience, not its 5 s socket timeout: 4 s is a margin a loaded machine keeps
    assert time.time() - t0 < 4, "a worker must notice soon that the trainer is gone"


# ---- hostile input: every request gets a 4xx, nothing queued is lost, nothing is unpickled ----

class Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))                             # creates the marker if ever unpickled


def raw_header(header: dict, data: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return len(h).to_bytes(8, "little") + h + data


def bad_batches(marker):
    """Bodies for POST /batch that must each get a 400 (or 409: well-formed but no lease granted)."""
    good = make_batch()
    t = {f: getattr(good, f) for f in ("states", "actions", "logp", "rewards", "mask", "truncated", "final_states")}
    meta = {"version": "1", "lease": "x", "run": "r", "group_size": "2"}
    blob = batch_to_bytes(good, "x", "r")
    out = [b"", b"garbage", b"\x00" * 8, b"\xff" * 64, os.urandom(100), os.urandom(5000), pickle.dumps(Evil(marker)),
           pickle.dumps(Evil(marker), protocol=0), json.dumps({"states": [1, 2]}).encode(), b"{}" * 50]
    out += [blob[:n] for n in (1, 7, 8, 9, 50, len(blob) // 2, len(blob) - 1)]       # truncated safetensors
    out += [(2 ** 63).to_bytes(8, "little") + blob[8:], (len(blob)).to_bytes(8, "little") + blob[8:],
            raw_header({"a": {"dtype": "F32", "shape": [2 ** 40, 2 ** 40], "data_offsets": [0, 2 ** 62]}}, b"\0" * 8),
            raw_header({"a": {"dtype": "F32", "shape": [10 ** 9], "data_offsets": [0, 4 * 10 ** 9]}}),
            raw_header({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
            raw_header({"a": {"dtype": "XX", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
            raw_header({"__metadata__": {"version": 1}}), raw_header([1, 2, 3]), b"\x05\0\0\0\0\0\0\0[[[[["]
    cases = []
    for f in t:                                                     # wrong dtype, wrong rank, missing, per field
        cases += [{**t, f: t[f].double()}, {**t, f: t[f].int()}, {**t, f: t[f][..., None]}, {**t, f: t[f][:2]}]
        cases.append({k: v for k, v in t.items() if k != f})
    for f in ("logp", "rewards", "mask", "states", "final_states"):
        for x in (float("nan"), float("inf"), -float("inf")):
            bad = t[f].clone()
            bad.view(-1)[3] = x
            cases.append({**t, f: bad})
    cases += [{**t, "actions": t["actions"][:, :3]}, {**t, "mask": t["mask"] * 2}, {**t, "extra": torch.ones(1)},
              {**t, "group_id": torch.tensor([0, 0, 1, 1])}, {**t, "states": t["states"][:, :, :2]},
              {**t, "final_states": t["final_states"][:, :2]}, {**t, "states": t["states"].long()}]
    out += [tensors_to_bytes(c, meta) for c in cases]
    for k, vals in {"version": ["-1", "0", "99", "1.5", "abc", "", "1e3", " "], "group_size": ["0", "3", "-2", "x"],
                    "lease": [""]}.items():
        out += [tensors_to_bytes(t, {**meta, k: v}) for v in vals]
    out += [tensors_to_bytes(t, {k: v for k, v in meta.items() if k != drop}) for drop in meta]
    out.append(tensors_to_bytes(t))                                 # no metadata at all
    out.append(blob)                                                # well-formed, lease never granted: 409
    return out


def status_of(port, method, path, headers=None, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request(method, path, body=body, headers=headers or {})
        return c.getresponse().status
    finally:
        c.close()


def status_raw(port, send_headers, body=b""):
    """Send exactly these header lines (no automatic Content-Length) and a body; -> status."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.putrequest("POST", "/batch", skip_accept_encoding=True)
        for k, v in send_headers.items():
            c.putheader(k, v)
        c.endheaders(body)
        return c.getresponse().status
    finally:
        c.close()


def status_socket(port, data: bytes):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        line = s.makefile("rb").readline()
    return int(line.split()[1])


def evil_adapter(kind):
    """An adapter body as a hostile trainer (or a man in the middle) could send it."""
    name = {"dotdot": "../escape", "abs": "/tmp/nanorl-abs", "nested": "a/../../x", "dir": "d/", "dot": "."}.get(kind, "f")
    t = torch.ones(2, 2, dtype=torch.uint8) if kind == "2d" else torch.ones(3) if kind == "float" else torch.ones(3, dtype=torch.uint8)
    return tensors_to_bytes({name: t})


def test_hostile_requests_get_4xx_and_lose_nothing(serve, tmp_path):
    marker = str(tmp_path / "unpickled")
    server, client = serve()
    good = make_batch(seed=42)
    submit(client, good)
    port, auth = server.port, {"Authorization": f"Bearer {TOKEN}"}
    paths = ["/info", "/weights?version=1", "/adapter?version=1", "/lease", "/batch", "/nope", "/"]
    statuses = []
    for p in paths:                                                 # no, wrong, mis-schemed tokens on every path
        for h in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                  {"Authorization": "Bearer "}, {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": TOKEN},
                  {"Authorization": "Bearer \u00e9\u00e9"}):
            statuses.append(status_of(port, "POST" if p in ("/lease", "/batch") else "GET", p, h, b"" if
                                      p in ("/lease", "/batch") else None))
    for p in ["/nope", "/version/", "/VERSION", "/../etc/passwd", "/%00", "/batch/x", "/" + "a" * 3000,
              "/weights/../info"]:               # unknown paths
        statuses += [status_of(port, "GET", p, auth), status_of(port, "POST", p, auth, b"")]
    for p in paths[:6]:                                             # wrong methods
        for m in ("PUT", "DELETE", "PATCH", "OPTIONS", "FOO", "POST" if p not in ("/lease", "/batch") else "GET"):
            statuses.append(status_of(port, m, p, auth, b"" if m != "GET" else None))
    for v in ("abc", "-1", "0", "99", "1.5", "", "%00", "2x", "%D9%A1"):   # bad queries
        statuses += [status_of(port, "GET", f"/weights?version={v}", auth),
                     status_of(port, "GET", f"/adapter?version={v}", auth)]
    for body in bad_batches(marker):                                # hostile batch bodies, also as a lease body
        statuses.append(status_of(port, "POST", "/batch", auth, body))
    statuses.append(status_of(port, "POST", "/lease", {"Authorization": "Bearer no"}, pickle.dumps(Evil(marker))))
    big = b"x" * (4 << 20)                                          # refused unread: still an answer, not a reset
    exact = [(413, status_raw(port, {**auth, "Content-Length": str(10 ** 12)}, b"small")),   # before the body
             (411, status_raw(port, auth)),
             (401, status_raw(port, {"Content-Length": str(10 ** 9)}, b"x")),                  # unread: answered now
             # without the token, a body is discarded up to STRANGER_LINGER bytes (more: see the next test)
             (403, status_of(port, "POST", "/batch", {"Authorization": "Bearer no"}, b"x" * STRANGER_LINGER)),
             (413, status_of(port, "POST", "/batch", auth, big))]
    assert [got for _, got in exact] == [want for want, _ in exact]
    statuses += [got for _, got in exact]
    statuses += [status_raw(port, {**auth, "Content-Length": n}, b"abc") for n in ("abc", "-3", "1e3", "+3")]
    short = f"POST /batch HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 100\r\n\r\nshort".encode()
    statuses += [status_socket(port, d) for d in (short, b"GARBAGE\r\n\r\n", b"GET /info\r\n\r\n",
                                                    b"\x16\x03\x01\x00\xa5\x01\x00\r\n\r\n",   # a TLS hello
                                                    b"GET " + b"a" * 70000 + b" HTTP/1.1\r\n\r\n")]
    assert len(statuses) >= 200
    assert all(400 <= s < 500 for s in statuses), sorted(set(statuses))
    assert not os.path.exists(marker), "a pickle was unpickled"
    for kind in ("dotdot", "abs", "nested", "dir", "dot", "2d", "float"):
        with pytest.raises(ValueError, match="refusing"):
            unpack_adapter(evil_adapter(kind), str(tmp_path / kind))
    with pytest.raises(ValueError, match="not safetensors"):
        unpack_adapter(b"not an adapter", str(tmp_path / "junk"))
    assert not os.path.exists("/tmp/nanorl-abs") and not os.path.exists(tmp_path / "escape")
    # the server still answers, the good batch survived bit for bit, and a new good submit works
    assert client.info()["version"] == 1
    assert same_batch(server.next_batches(1, 1, timeout=1)[0], good)
    server.publish(2, {"w": torch.zeros(3)})        # the trainer took its batch: the next lease is for version 2
    submit(client, make_batch(version=2, seed=7))
    assert same_batch(server.next_batches(1, 2, timeout=1)[0], make_batch(version=2, seed=7))
    assert server.counters["received"] == 2


def test_a_client_without_the_token_is_cut_off_after_its_answer(serve):
    """Junk after a 403 is read for STRANGER_LINGER bytes, then left unread until the reset LINGER_S s after the
    answer: the client can push that, the server's StreamReader buffer (2 x MAX_HEAD), its kernel's receive
    buffer (at most tcp_rmem's max) and its own send buffer (fixed here), and no more. Before, it streamed into
    the trainer's process for LINGER_S s: hundreds of MB over loopback. A bound in bytes, not in time."""
    try:
        rmem = int(open("/proc/sys/net/ipv4/tcp_rmem").read().split()[2])
    except OSError:
        pytest.skip("no /proc/sys/net/ipv4/tcp_rmem (not Linux): the server's receive buffer is unknown")
    server, _ = serve()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)     # a fixed size: no autotuning
        s.sendall(b"POST /batch HTTP/1.1\r\nAuthorization: Bearer wrong\r\nContent-Length: 1000000000\r\n\r\n")
        assert s.makefile("rb").readline().startswith(b"HTTP/1.1 403 ")
        bound = STRANGER_LINGER + 2 * MAX_HEAD + rmem + s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        sent, junk = 0, b"x" * (1 << 16)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            while sent <= bound:
                sent += s.send(junk)
    assert server.counters == {} and TrainerClient(f"http://127.0.0.1:{server.port}", TOKEN).info()["version"] == 1


def test_a_batch_due_now_is_waited_for_not_overtaken(serve):
    """k = 1. Lease a at v1; the trainer moves to v2; lease b at v2 and b's batch arrives first. At v2,
    a's batch is usable now or never (2 - 1 = k), so the trainer waits for it instead of taking b's."""
    server, client = serve(max_staleness=1)
    run, _, lease_a = client.lease()
    server.publish(2, {"w": torch.zeros(3)})
    submit(client, make_batch(version=2, seed=2))
    import threading
    threading.Timer(0.3, lambda: client.submit(make_batch(version=1, seed=1), lease_a, run)).start()
    got = server.next_batches(1, 2, timeout=5)
    assert same_batch(got[0], make_batch(version=1, seed=1))
    assert server.counters["dropped_stale"] == 0


def test_a_step_waits_for_a_due_lease_only_while_it_proves_life(serve):
    """k = 1, lease_timeout 1 s. Lease a at v1 is due at v2: while its worker renews it, the step waits for
    it (1.5 lease_timeouts here); once the renewals stop (kill -9), the step goes on within lease_timeout.
    Margins a loaded machine keeps: a renewal (every 0.2 s) may come 0.8 s late; the step may take 2 s
    more than lease_timeout, far from the 30 s it would wait for a lease that never expired."""
    server, client = serve(max_staleness=1, lease_timeout=1.0)
    _, _, due = client.lease()
    server.publish(2, {"w": torch.zeros(3)})
    submit(client, make_batch(version=2, seed=2))
    with client.keep_alive(due), pytest.raises(TimeoutError):
        server.next_batches(1, 2, timeout=1.5)
    t0 = time.monotonic()
    got = server.next_batches(1, 2, timeout=30)
    assert time.monotonic() - t0 < 1.0 + 2.0 and same_batch(got[0], make_batch(version=2, seed=2))
    assert server.counters["leases_expired"] == 1


def test_leases_prove_life_and_a_worker_holds_at_most_its_cap(serve):
    server, client = serve(max_staleness=2, lease_timeout=1.0)     # room (2 + 1) * 1 = 3
    (run, _, alive), (_, _, silent) = client.lease(), client.lease()
    assert client.lease() is None and server.counters["leases_refused"] == 1            # the cap, not the room:
    other = TrainerClient(client.url, TOKEN, patience=0.05)                           # another worker gets the 3rd
    assert other.lease() is not None
    with client.keep_alive(alive):              # renewed every 0.2 s: one may come 0.8 s late, on a loaded machine
        time.sleep(2.0)
    assert server.counters["leases_expired"] == 2                                     # the two silent ones
    client.submit(make_batch(), alive, run)                                           # 2 lease_timeouts later
    with pytest.raises(Rejected) as e:
        client.submit(make_batch(), silent, run)
    assert e.value.status == 409
    with pytest.raises(Rejected) as e:                                                # no worker id: refused
        client._call("POST", "/lease", b"")
    assert e.value.status == 400


def test_a_batch_from_another_run_is_refused_and_counted(serve):
    server, client = serve()
    assert TrainerServer(TOKEN, FP, 2, limits=LIMITS).run != server.run               # a new id per start
    run, _, lease = client.lease()
    with pytest.raises(Rejected) as e:                  # a worker still holding the previous run's weights
        client.submit(make_batch(), lease, "a" * 16)
    assert e.value.status == 409 and server.counters["wrong_run"] == 1 and server.counters["received"] == 0
    client.submit(make_batch(), lease, run)
    assert server.counters["received"] == 1


def bad_for_the_run(limits, version=1):
    """(reason, batch) pairs: each batch well-formed on the wire, with one thing the run of `limits` (its /info)
    cannot produce. The base batch is one it can: rows of a 1-2 token prompt and 1-2 tokens, or <= 5 steps."""
    G, P, prompt, L, A, (lo, hi) = (limits[k] for k in ("group_size", "n_prompts", "prompt_len", "max_len",
                                                        "n_actions", "reward"))
    llm, N, steps = prompt > 0, G * P, ("states", "actions", "logp", "rewards", "mask")   # [N, T, ..] fields
    kw = {"version": version, "G": G, "llm": llm, "V": A}
    b = make_batch(N=N, T=3 if llm else 5, **kw)
    s, e = int(b.mask[0].argmax()), int(b.mask[0].argmax() + b.mask[0].sum())       # row 0's trained span

    def edit(field, fn, batch=b):
        x = getattr(batch, field).clone()
        fn(x)
        return replace(batch, **{field: x})
    out = [("this run takes", make_batch(N=N + G, **kw)),                             # one prompt too many
           ("is not in 1..", make_batch(N=N, T=prompt + L + 1, **kw)),                # T one past the budget
           ("is not in 1..", replace(b, **{f: getattr(b, f)[:, :0] for f in steps})),   # T 0: was a 500
           ("every row's mask needs a 1", edit("mask", lambda m: m[0].zero_())),                # an empty row
           ("mask must be 0 or 1", edit("mask", lambda m: m[0].__setitem__(e - 1, 0.5))),
           ("start after its prompt" if llm else "runs of 0s between 1s are insertions: at most 0",   # a hole
            edit("mask", lambda m: m[0].copy_(torch.tensor([1.0, 0, 1] + [0] * (len(m[0]) - 3))))),
           ("total within", edit("rewards", lambda r: r[0].__setitem__(e - 1, hi + 1))),
           ("not this run's", make_batch(N=N, **{**kw, "llm": not llm}))]             # rows of the other kind
    if llm:
        out.append(("final_states", replace(b, final_states=torch.zeros(N, 1))))
    else:                                                       # PPO's critic bootstraps from them: a crash
        out.append(("final_states", replace(b, final_states=None)))
    if llm:
        wide = make_batch(N=N, T=prompt + 2, **kw)
        out += [("token ids must be in", edit("actions", lambda x: x[0].__setitem__(0, A),
                                              edit("states", lambda x: x[0].__setitem__(0, A)))),
                ("actions equal states", edit("actions", lambda x: x[0].__setitem__(s, (x[0, s] + 1) % A))),
                ("start after its prompt", edit("mask", lambda m: m[0, :e].fill_(1))),  # a mask on position 0
                ("start after its prompt", edit("mask", lambda m: (m[0].zero_(), m[0, prompt + 1].fill_(1)), wide)),
                ("last completion token", edit("rewards", lambda r: r[0].__setitem__(0, 0.5))),
                ("total within", edit("rewards", lambda r: r[0].__setitem__(e - 1, lo - 1)))]
        if prompt >= 2:                                                               # a completion one too long
            out.append(("span at most", edit("mask", lambda m: m[0, 1:L + 2].fill_(1),
                                                       make_batch(N=N, T=prompt + L, **kw))))
    else:
        short = edit("mask", lambda m: m[0, 1:].zero_())
        out += [("action ids must be in", edit("actions", lambda a: a[0].__setitem__(0, A))),
                ("action ids must be in", edit("actions", lambda a: a[0].__setitem__(0, -1))),
                ("a row starts at step 0", edit("mask", lambda m: (m[0].zero_(), m[0, 1:3].fill_(1)))),
                ("masked steps", edit("rewards", lambda r: r[0].__setitem__(3, 1.0), replace(short, rewards=short.mask.clone()))),
                ("not this run's", replace(b, states=torch.randn(N, 5, 5), final_states=torch.randn(N, 5)))]
    return out


@pytest.mark.parametrize("llm", [False, True], ids=["control", "llm"])
def test_a_batch_this_run_cannot_produce_gets_400_with_the_reason(serve, llm):
    server, client = serve(limits=LLM_LIMITS if llm else LIMITS)
    good = make_batch(llm=llm, seed=5)
    submit(client, good)
    run, _, lease = client.lease()                      # a valid token and lease: only the batch is wrong
    cases = bad_for_the_run(LLM_LIMITS if llm else LIMITS)
    for why, bad in cases:
        with pytest.raises(Rejected) as e:
            client.submit(bad, lease, run)
        assert e.value.status == 400 and why in str(e.value), (why, str(e.value))
    assert server.counters["refused"] == len(cases) and server.counters["received"] == 1
    client.submit(make_batch(llm=llm, seed=6), lease, run)                            # the lease still holds
    assert same_batch(server.next_batches(1, 1, timeout=1)[0], good)
    # a body is at most what this run's largest batch can be: refused on its Content-Length, unread. Both runs:
    # N = 4 rows; control T = 5, O = 4: states 4*5*4*4 = 320, actions 4*5*8 = 160, logp/rewards/mask 3*4*5*4 = 240,
    # truncated 4, final_states 4*4*4 = 64; LLM T = 3 + 4 = 7: states and actions 2*4*7*8 = 448,
    # logp/rewards/mask 3*4*7*4 = 336, truncated 4. 788 bytes either way, + a 16 KiB header
    assert server.max_body == 788 + (16 << 10)
    assert len(batch_to_bytes(make_batch(llm=llm, T=7 if llm else 5), "L" * 32, "R" * 16)) <= server.max_body
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert status_raw(server.port, {**auth, "Content-Length": str(server.max_body + 1)}) == 413


def test_idle_and_trickling_clients_cannot_hold_the_server(serve):
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:                                     # 500 idle sockets here + the server's 256 in this process
        if hard != resource.RLIM_INFINITY and hard < 1200:
            pytest.skip(f"ulimit -n: the hard limit {hard} is too low for 500 idle sockets + the server's")
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard) if hard != resource.RLIM_INFINITY else 2048, hard))
    # headers + body within 2 s. A step of the honest worker takes ms; the margins below (1 s for a step,
    # 1.5 s for stop()) are a loaded machine's, and still under the 2 s a step held by a trickler would take
    server, client = serve(timeout=2.0)
    port = server.port

    def trickle():
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /batch HTTP/1.1\r\n")
        return s
    def work(seconds, tricklers, v):                    # an honest worker and the trainer, meanwhile
        t0, slowest = time.monotonic(), 0.0
        while time.monotonic() - t0 < seconds:
            for s in tricklers:
                with contextlib.suppress(OSError):
                    s.sendall(b"X-Slow: 1\r\n")      # a header line at every step
            t = time.monotonic()
            submit(client, make_batch(version=v))
            server.next_batches(1, v, timeout=1)
            v += 1
            server.publish(v, {"w": torch.zeros(3)})
            slowest = max(slowest, time.monotonic() - t)
        return slowest, v
    trickler = trickle()
    slowest, v = work(2.5, [trickler], 1)
    trickler.settimeout(10)
    assert trickler.recv(100).startswith(b"HTTP/1.1 408 ") and slowest < 1.0   # cut at its deadline
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(500)]
    tricklers = [trickle()]
    slowest, v = work(0.5, tricklers, v)
    assert slowest < 1.0
    t = time.monotonic()
    server.stop()
    assert time.monotonic() - t < 1.5                   # with 256 idle sockets and a trickler connected
    for s in idle + tricklers:
        s.close()


def test_finish_answers_410_to_every_request_and_to_the_lease_waiting(serve):
    """k = 0: one lease fills the room, so another worker's lease waits (a long poll). finish(grace) answers
    that poll at once (before the grace ends), the holder's renewal and any later request 410 with the run
    id, and returns after grace s (+ 3 s: a margin a loaded machine keeps)."""
    import threading
    server, client = serve(max_staleness=0)
    _, _, held = client.lease()
    other, heard = TrainerClient(client.url, TOKEN, timeout=5, patience=0.05, backoff=0.01), []

    def lease_waiting():
        with pytest.raises(Rejected) as e:
            other.lease(wait=10)
        heard.append((e.value, time.monotonic()))
    poll = threading.Thread(target=lease_waiting)
    poll.start()
    time.sleep(0.5)                                                 # it waits for room
    t0 = time.monotonic()
    returned = []
    finisher = threading.Thread(target=lambda: (server.finish(1.5), returned.append(time.monotonic())))
    finisher.start()
    poll.join(5)
    with pytest.raises(Rejected) as renew:
        client._call("POST", f"/renew?lease={held}", b"")
    finisher.join(5)
    took = time.monotonic() - t0
    (waited, at), = heard
    assert [waited.status, renew.value.status] == [410, 410] and at < returned[0] and 1.4 < took < 1.5 + 3
    assert f"run {server.run} finished" in str(waited) and f"run {server.run} finished" in str(renew.value)


def read_answer(sock, pace: float) -> tuple[int, bytes]:
    """An HTTP answer read from a raw socket in 64 KiB pieces, at most `pace` bytes/s -> (status, body so
    far): a cut connection ends it early."""
    data, t0, head = bytearray(), time.monotonic(), None
    with contextlib.suppress(ConnectionResetError):
        while piece := sock.recv(1 << 16):
            data += piece
            if head is None and b"\r\n\r\n" in data:
                head, _, rest = bytes(data).partition(b"\r\n\r\n")
                data = bytearray(rest)
            time.sleep(max(0.0, len(data) / pace - (time.monotonic() - t0)))  # ~1 ms: far under any deadline
    return int(head.split()[1]), bytes(data)


def test_a_slow_download_gets_every_byte_and_a_stalled_one_is_cut(serve):
    """50 MB of weights, server timeout 1 s. A reader paced to take 3 timeouts (never pausing for one, which
    leaves a loaded machine 1 s) gets every byte; a reader that stops reading is cut a timeout or two after its
    last byte moved (+ 3 s: a loaded machine's margin; never cut, it would hold its connection for good)."""
    server, _ = serve(timeout=1.0)
    server.publish(2, {"w": torch.arange(50 << 18, dtype=torch.float32)})    # far over the socket buffers
    weights = server._blobs["weights"]
    ask = (f"GET /weights?version=2&run={server.run} HTTP/1.1\r\n"
           f"Authorization: Bearer {TOKEN}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(ask)
        t0 = time.monotonic()
        status, body = read_answer(s, pace=len(weights) / 3.0)
    took = time.monotonic() - t0
    assert status == 200 and len(body) == len(weights) and body == weights and took > 2.5
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(ask)
        got = len(s.recv(1 << 20))                                  # then stops reading
        t0 = time.monotonic()
        while asyncio.all_tasks(server._loop) and time.monotonic() - t0 < 10:     # its handler's
            time.sleep(0.01)
        cut = time.monotonic() - t0
        with contextlib.suppress(ConnectionResetError):
            while piece := s.recv(1 << 16):
                got += len(piece)
        assert 0.9 < cut < 2 + 3 and got < len(weights), (cut, got)


@pytest.mark.parametrize("busy_threads", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_stop_ends_every_connection_even_on_a_loop_starved_of_the_gil(monkeypatch, busy_threads):
    """stop() ends every connection at once: one accepted as it began (its handler not yet started) and one
    whose cancel Python 3.10/3.11's wait_for swallowed (its read completed in the same loop turn) included.
    In CI a worker thread and torch starved the server's loop of the GIL: a worker's long-poll hung past
    stop(), and the worker outlived its test. Then, with other work beside the suite, stop()'s wait for the
    cancelled handlers timed out (0.1 s) and the loop stopped with their sockets' closes still queued: 3
    clients of 40 waited out their socket timeouts. Here every such wait times out at once, so each round
    meets that race (before the fix every round hung a client; with 3 busy threads, 54 of 80 clients hung)."""
    import threading
    wait = asyncio.wait
    monkeypatch.setattr(asyncio, "wait", lambda tasks, timeout: wait(tasks, timeout=0))
    busy = threading.Event()
    def spin():
        while not busy.is_set():
            pass
    spinners = [threading.Thread(target=spin) for _ in range(busy_threads)]
    for t in spinners:
        t.start()
    outcomes = []
    def wait_for_a_lease(client):
        try:
            client.lease(wait=60)                       # no room: held until stop() ends it
            outcomes.append("leased")
        except (TrainerGone, Rejected) as e:
            outcomes.append(str(e))
    try:
        for i in range(10):
            server = TrainerServer(TOKEN, FP, 0, host="127.0.0.1", port=0, limits=LIMITS).start()
            server.publish(1, {"w": torch.zeros(3)})
            url = f"http://127.0.0.1:{server.port}"
            TrainerClient(url, TOKEN).lease()           # the only room (k = 0, one batch per step)
            clients = [threading.Thread(target=wait_for_a_lease, args=(TrainerClient(url, TOKEN, timeout=10,
                                                                                     patience=0),))
                       for _ in range(4)]
            for t in clients:
                t.start()
            time.sleep(0.01 + 0.003 * (i % 7))          # stop() lands at a different moment in each round
            server.stop()
            for t in clients:
                t.join()
    finally:
        busy.set()
        for t in spinners:
            t.join()
    hung = [o for o in outcomes if "timed out" in o]
    assert len(outcomes) == 40 and "leased" not in outcomes and not hung, hung


def test_tool_replies_and_turns_are_holes_in_a_completions_mask_and_nothing_else_is(serve):
    """A tool reply or an environment's user turn is a run of 0s inside a completion (tasks.LLMTask.reply, an
    episode's environment): accepted up to --max-tool-calls + --max-turns - 1 of them; more, or a completion
    that starts early and so spans more than the budget, get a 400 naming the rule each breaks."""
    limits = {**LLM_LIMITS, "prompt_len": 2, "max_len": 6, "insertions": 1}     # train.batch_limits: 1 + 1 - 1
    server, client = serve(limits=limits)
    good = make_batch(N=4, T=8, llm=True, seed=1)
    # row 0: prompt 2, completion of 6 whose positions 3-4 are a reply: mask 0 0 1 0 0 1 1 1, reward last
    good.mask[0] = torch.tensor([0, 0, 1, 0, 0, 1, 1, 1.0])
    good.states[0], good.rewards[0] = torch.arange(1, 9), torch.tensor([0, 0, 0, 0, 0, 0, 0, 1.0])
    good.actions[0], good.logp[0] = good.states[0], -0.5 * good.mask[0]
    assert good.insertions().tolist() == [1, 0, 0, 0]
    submit(client, good)
    assert same_batch(server.next_batches(1, 1, timeout=1)[0], good)
    two = replace(good, mask=good.mask.clone())
    two.mask[0] = torch.tensor([0, 0, 1, 0, 1, 0, 1, 1.0])                            # 2 replies, 1 allowed
    wide = replace(good, mask=good.mask.clone())
    wide.mask[0] = torch.tensor([0, 1, 0, 0, 1, 1, 1, 1.0])                            # spans 7 > 6 tokens
    run, _, lease = client.lease()
    for bad, why in ((two, "insertions: at most 1 (--max-tool-calls + --max-turns - 1)"), (wide, "span at most 6")):
        with pytest.raises(Rejected) as e:
            client.submit(bad, lease, run)
        assert e.value.status == 400 and why in str(e.value), str(e.value)
    limits0 = {**limits, "insertions": 0}                                              # tools off: no holes
    with pytest.raises(ValueError, match="at most 0"):
        batch_from_bytes(batch_to_bytes(good, "lease", "run"), limits0)
    # turns: 3 turns make 2 holes, within the budget of --max-turns 3 and not of 2; a tool call adds one
    from tasks import CartPole
    from train import Config, batch_limits
    for tools, turns, ok in [(0, 3, True), (0, 2, False), (1, 2, True), (1, 1, False)]:
        cfg = Config(max_tool_calls=tools, max_turns=turns)             # the budget as train.py states it
        budget = {**limits, "insertions": batch_limits(cfg, CartPole(), None, 2)["insertions"]}
        sent = batch_to_bytes(two, "lease", "run")
        if ok:
            assert batch_from_bytes(sent, budget)[0].insertions()[0] == 2
        else:
            with pytest.raises(ValueError, match="at most 1 "):
                batch_from_bytes(sent, budget)
