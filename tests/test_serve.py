"""The async transport against a real server on 127.0.0.1: round trips, staleness, leases, and hostile input."""
import http.client
import io
import json
import os
import pickle
import socket
import tarfile
import time

import pytest
import torch

from core import Batch
from serve import (Rejected, Snapshots, TrainerClient, TrainerGone, TrainerServer, batch_from_bytes, batch_to_bytes,
                   describe, tensors_from_bytes, tensors_to_bytes, unpack_adapter)

TOKEN = "test-token-0123456789"
FP = {"task": "cartpole", "split_seed": 0}


def make_batch(version=1, N=4, G=2, T=5, llm=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    states = torch.randint(0, 50, (N, T), generator=g) if llm else torch.randn(N, T, 4, generator=g)
    return Batch(states=states, actions=torch.randint(0, 2, (N, T), generator=g),
                 logp=-torch.rand(N, T, generator=g), rewards=torch.randn(N, T, generator=g),
                 mask=(torch.rand(N, T, generator=g) > 0.3).float(), truncated=torch.rand(N, generator=g) > 0.5,
                 group_id=torch.arange(N // G).repeat_interleave(G),
                 final_states=None if llm else torch.randn(N, 4, generator=g), group_size=G, version=version)


def same_batch(a, b):
    fields = ("states", "actions", "logp", "rewards", "mask", "truncated", "group_id", "final_states")
    return (a.group_size, a.version) == (b.group_size, b.version) and all(
        (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y))
        for x, y in ((getattr(a, f), getattr(b, f)) for f in fields))


@pytest.fixture
def serve(request):
    """serve(**kw) -> (server, client) on 127.0.0.1:<free port>, weights v1 published; stopped after the test."""
    servers = []

    def make(max_staleness=2, batches_per_step=1, publish=True, **kw):
        s = TrainerServer(TOKEN, FP, max_staleness, batches_per_step, host="127.0.0.1", port=0, **kw).start()
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
    for b in (make_batch(), make_batch(llm=True)):                   # [N, T, 4] with final_states; [N, T] long without
        got, meta = batch_from_bytes(batch_to_bytes(b, "L1"))
        assert same_batch(got, b) and meta["lease"] == "L1"


def test_publish_version_weights_and_the_cpu_alias(serve):
    server, client = serve(publish=False)
    live = torch.zeros(3)
    server.publish(1, {"w": live, "b": torch.ones(2, 2)})
    live.add_(7)                                                    # the optimizer steps in place after publishing
    assert client.version() == 1
    got = client.weights(1)
    assert torch.equal(got["w"], torch.zeros(3))
    assert client.info()["names"] == {"w": [[3], "float32"], "b": [[2, 2], "float32"]}
    server.publish(2, {"w": live, "b": torch.ones(2, 2)})
    with pytest.raises(Rejected) as e:                              # only the current version is served
        client.weights(1)
    assert e.value.status == 404
    assert torch.equal(client.weights(2)["w"], torch.full((3,), 7.0))
    with pytest.raises(ValueError, match="only increase"):
        server.publish(2, {"w": live})


def test_adapter_tar_round_trip(serve, tmp_path):
    server, client = serve()
    files = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": tensors_to_bytes({"a": torch.ones(2)})}
    server.publish(2, {"w": torch.zeros(3)}, adapter_files=files)
    out = client.adapter(2, str(tmp_path / "v2"))
    assert {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)} == files
    with pytest.raises(ValueError, match="plain file name"):
        server.publish(3, {"w": torch.zeros(3)}, adapter_files={"../evil": b""})


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


def test_snapshots_keep_exactly_the_last_k_plus_2_versions_and_never_alias():
    snaps, live = Snapshots(max_staleness=2), torch.zeros(3)
    for v in range(1, 8):
        live.fill_(v)                                               # the optimizer steps in place
        snaps.add(v, {"w": live})
    assert [v for v in range(1, 8) if snaps.get(v) is not None] == [4, 5, 6, 7]   # k + 2 = 4
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
    server, client = serve(max_staleness=1, batches_per_step=1, lease_timeout=0.5)   # room (1 + 1) * 1 = 2
    (v1, a), (v2, b) = client.lease(), client.lease()
    assert v1 == v2 == 1 and client.lease() is None and client.retry_after > 0
    client.submit(make_batch(), a)
    with pytest.raises(Rejected) as e:                              # a lease is used once
        client.submit(make_batch(), a)
    assert e.value.status == 409
    with pytest.raises(Rejected) as e:
        client.submit(make_batch(), "never-granted")
    assert e.value.status == 409
    with pytest.raises(Rejected) as e:
        client.submit(make_batch(), "")
    assert e.value.status == 400
    assert client.lease() is None                                   # 1 queued + lease b = 2: full
    time.sleep(0.6)                                                 # b expires: its slot comes back
    assert client.lease() is not None and server.counters["leases_expired"] == 1
    with pytest.raises(Rejected) as e:
        client.submit(make_batch(), b)
    assert e.value.status == 409


def test_lease_refused_when_the_batch_would_arrive_stale(serve):
    # k = 0: the trainer took its batch for version 1, so a batch started now at v1 would be used at v2
    # (staleness 1 > 0): room = 0 * 1 + (1 - 1 taken) = 0. Publishing v2 reopens room = 1.
    server, client = serve(max_staleness=0)
    client.submit(make_batch(), client.lease()[1])
    assert server.next_batches(1, 1, timeout=1)
    assert client.lease() is None
    server.publish(2, {"w": torch.zeros(3)})
    assert client.lease()[0] == 2 and client.lease() is None


def test_check_names_what_differs(serve):
    server, client = serve()
    client.check(dict(FP), describe({"w": torch.zeros(3)}))
    with pytest.raises(ValueError, match="split_seed"):
        client.check({**FP, "split_seed": 1}, describe({"w": torch.zeros(3)}))
    with pytest.raises(ValueError, match="'w'"):
        client.check(FP, describe({"w": torch.zeros(4)}))


def test_empty_token_and_gone_trainer(serve):
    with pytest.raises(ValueError, match="NANORL_TOKEN"):
        TrainerServer("", FP, 2)
    server, client = serve()                                        # the client: 2 tries, 0.01 s backoff
    assert client.version() == 1
    server.stop()
    t0 = time.time()
    with pytest.raises(TrainerGone):
        client.version()
    assert time.time() - t0 < 2, "a worker must notice soon that the trainer is gone"


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
    t = {f: getattr(good, f) for f in ("states", "actions", "logp", "rewards", "mask", "truncated", "group_id",
                                       "final_states")}
    meta = {"version": "1", "lease": "x", "group_size": "2", "final_states": "1"}
    blob = batch_to_bytes(good, "x")
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
              {**t, "group_id": torch.tensor([0, 1, 0, 1])}, {**t, "states": t["states"][:, :, :2]},
              {**t, "final_states": t["final_states"][:, :2]}, {**t, "states": t["states"].long()}]
    out += [tensors_to_bytes(c, meta) for c in cases]
    for k, vals in {"version": ["-1", "0", "99", "1.5", "abc", "", "1e3", " "], "group_size": ["0", "3", "-2", "x"],
                    "final_states": ["0", "2", ""], "lease": [""]}.items():
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


def evil_tar(kind):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo({"dotdot": "../escape", "abs": "/tmp/nanorl-abs", "nested": "a/../../x",
                                "dir": "d", "symlink": "link", "hardlink": "hl"}[kind])
        if kind == "symlink":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        elif kind == "hardlink":
            info.type, info.linkname = tarfile.LNKTYPE, "/etc/passwd"
        elif kind == "dir":
            info.type = tarfile.DIRTYPE
        tar.addfile(info, io.BytesIO(b"") if info.isfile() else None)
    return buf.getvalue()


def test_hostile_requests_get_4xx_and_lose_nothing(serve, tmp_path):
    marker = str(tmp_path / "unpickled")
    server, client = serve(max_body=1 << 20)
    good = make_batch(seed=42)
    client.submit(good, client.lease()[1])
    port, auth = server.port, {"Authorization": f"Bearer {TOKEN}"}
    paths = ["/version", "/info", "/weights?version=1", "/adapter?version=1", "/lease", "/batch", "/nope", "/"]
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
             (403, status_of(port, "POST", "/batch", {"Authorization": "Bearer no"}, big)),
             (413, status_of(port, "POST", "/batch", auth, big))]
    assert [got for _, got in exact] == [want for want, _ in exact]
    statuses += [got for _, got in exact]
    statuses += [status_raw(port, {**auth, "Content-Length": n}, b"abc") for n in ("abc", "-3", "1e3", "+3")]
    short = f"POST /batch HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 100\r\n\r\nshort".encode()
    statuses += [status_socket(port, d) for d in (short, b"GARBAGE\r\n\r\n", b"GET /version\r\n\r\n",
                                                    b"\x16\x03\x01\x00\xa5\x01\x00\r\n\r\n",   # a TLS hello
                                                    b"GET " + b"a" * 70000 + b" HTTP/1.1\r\n\r\n")]
    assert len(statuses) >= 200
    assert all(400 <= s < 500 for s in statuses), sorted(set(statuses))
    assert not os.path.exists(marker), "a pickle was unpickled"
    for kind in ("dotdot", "abs", "nested", "dir", "symlink", "hardlink"):
        with pytest.raises(ValueError, match="refusing"):
            unpack_adapter(evil_tar(kind), str(tmp_path / kind))
    with pytest.raises(ValueError):
        unpack_adapter(b"not a tar", str(tmp_path / "junk"))
    assert not os.path.exists("/tmp/nanorl-abs") and not os.path.exists(tmp_path / "escape")
    # the server still answers, the good batch survived bit for bit, and a new good submit works
    assert client.version() == 1
    assert same_batch(server.next_batches(1, 1, timeout=1)[0], good)
    client.submit(make_batch(seed=7), client.lease()[1])
    assert same_batch(server.next_batches(1, 1, timeout=1)[0], make_batch(seed=7))
    assert server.counters["received"] == 2


def test_a_batch_due_now_is_waited_for_not_overtaken(serve):
    """k = 1. Lease a at v1; the trainer moves to v2; lease b at v2 and b's batch arrives first. At v2,
    a's batch is usable now or never (2 - 1 = k), so the trainer waits for it instead of taking b's."""
    server, client = serve(max_staleness=1)
    _, lease_a = client.lease()
    server.publish(2, {"w": torch.zeros(3)})
    _, lease_b = client.lease()
    client.submit(make_batch(version=2, seed=2), lease_b)
    import threading
    threading.Timer(0.3, lambda: client.submit(make_batch(version=1, seed=1), lease_a)).start()
    got = server.next_batches(1, 2, timeout=5)
    assert same_batch(got[0], make_batch(version=1, seed=1))
    assert server.counters["dropped_stale"] == 0


def test_a_dead_workers_due_lease_stops_blocking_when_it_expires(serve):
    server, client = serve(max_staleness=1, lease_timeout=0.5)
    client.lease()                                                  # this worker dies
    server.publish(2, {"w": torch.zeros(3)})
    _, lease_b = client.lease()
    client.submit(make_batch(version=2, seed=2), lease_b)
    t0 = time.monotonic()
    got = server.next_batches(1, 2, timeout=5)
    assert 0.3 < time.monotonic() - t0 < 3 and same_batch(got[0], make_batch(version=2, seed=2))
    assert server.counters["leases_expired"] == 1
