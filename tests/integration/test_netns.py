"""Across hosts: broker, encoder and PD worker in three Linux network namespaces.

Each process gets its own network stack (its own loopback, one veth on a bridge held by a fourth
namespace, 10.213.Y.0/24), so every link between them is real TCP through a virtual switch, as
between machines. They are started with the real CLI (`epdq broker` / `epdq worker` under
`ip netns exec`) with CURVE keys made by `epdq keygen`. The encoder's fetch socket is bound to
0.0.0.0 and advertises its veth address (the interface that routes to the broker); the PD worker has another node id, so it copies the embeddings over TCP from the
encoder (the remote fetch path) instead of from the shared-memory ring (which /dev/shm would
otherwise let it read: namespaces do not separate it). The test process, in the root namespace,
is the client, reaching the broker through its own veth on the same switch.

Checked: greedy output token-identical to the single-host colocated engine (a `both` worker over
ipc in the same test); the broker counted remote hand-offs only; the PD worker holds an established
TCP connection to the encoder's fetch port from its own address; a sniffer on the switch sees every
ZMTP link greet with the CURVE mechanism and never the prompt or image bytes; plaintext is refused
(the client library and `epdq broker --insecure` refuse non-loopback plaintext, and the broker and
the encoder's fetch socket answer a raw NULL-mechanism peer with nothing, while a CURVE peer with
the cluster keys gets answers).

Skipped with the reason when namespaces cannot be made (not root, no iproute2, no permission).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from epdq import AsyncClient, BrokerUnavailableError, ConfigError
from epdq import protocol as P
from epdq.cluster import Cluster, ClusterSpec
from epdq.demo import demo_image
from epdq.security import KeyPair, load_keypair, load_public_key

from .netns import NetLab, NetnsUnavailable, check_available

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MAX_TOKENS = 12
PORT = 7700
START_TIMEOUT_S = 240.0
REQUESTS = [  # (prompt, images): distinct images, so each one is encoded and fetched
    ("Across hosts: describe it.", [demo_image(101, (112, 112))]),
    ("Across hosts: compare them.", [demo_image(102, (160, 96)), demo_image(103, (84, 140))]),
]


def epdq_cli() -> list[str]:
    exe = Path(sys.executable).parent / "epdq"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "cli.main"]


def child_env() -> dict[str, str]:
    env = dict(os.environ)  # EPDQ_HOME, HF_HOME, VLLM_* from tests/conftest.py
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


@pytest.fixture
def lab(tmp_path):
    try:
        check_available()
    except NetnsUnavailable as e:
        if os.environ.get("EPDQ_REQUIRE_NETNS") == "1":  # CI (root): a skip there would prove nothing
            pytest.fail(f"network namespaces unavailable but EPDQ_REQUIRE_NETNS=1: {e}")
        pytest.skip(f"network namespaces unavailable: {e}")
    lab = NetLab(["broker", "enc", "pd"], tmp_path / "logs")
    try:
        lab.build()
        yield lab
    finally:
        lab.close()


# ------------------------------------------------------------------ helpers


async def single_host_reference(model_dir: str, d: Path) -> list[list[int]]:
    """Greedy tokens of each request on the colocated engine, one host, ipc (no network at all)."""
    spec = ClusterSpec(address=f"ipc://{d}/sock/broker", encoders=0, pds=0, both=1, model=model_dir,
                       log_dir=str(d / "logs"), start_timeout_s=START_TIMEOUT_S)  # fmt: skip
    cluster = Cluster(spec)
    try:
        await cluster.start()
        async with cluster.client(timeout=120) as c:
            return [
                (
                    await c.generate(p, images=ims, max_tokens=MAX_TOKENS, temperature=0.0, route="colocated")
                ).token_ids
                for p, ims in REQUESTS
            ]
    finally:
        await asyncio.to_thread(cluster.stop)


async def wait_workers(lab: NetLab, client: AsyncClient, want: dict[str, int], timeout: float) -> dict:
    end = time.monotonic() + timeout
    s = None
    while True:
        lab.check_alive()
        try:
            s = await client.stats(timeout=2.0)
            if all(s["gauges"].get(f"workers_{r}", 0) >= n for r, n in want.items()):
                return s
        except BrokerUnavailableError:
            pass
        if time.monotonic() > end:
            raise AssertionError(
                f"workers not registered within {timeout}s; last stats {s}; logs in {lab.log_dir}"
            )
        await asyncio.sleep(0.5)


def tcp_connections(lab: NetLab, host: str) -> list[tuple[str, int, str, int, str]]:
    """(local ip, local port, remote ip, remote port, state hex) from /proc/net/tcp inside `host`."""
    r = lab.run(host, ["cat", "/proc/net/tcp"])
    assert r.returncode == 0, r.stderr

    def addr(field: str) -> tuple[str, int]:
        h, p = field.split(":")
        return socket.inet_ntoa(bytes.fromhex(h)[::-1]), int(p, 16)

    out = []
    for line in r.stdout.splitlines()[1:]:
        f = line.split()
        (la, lp), (ra, rp) = addr(f[1]), addr(f[2])
        out.append((la, lp, ra, rp, f[3]))
    return out


ESTABLISHED, LISTEN = "01", "0A"


def raw_request(endpoint: str, msg, *, curve: tuple[KeyPair, bytes] | None, wait_s: float) -> list | None:
    """Send one message on a fresh DEALER (plaintext unless `curve`); the reply frames, or None."""
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            pair, server_public = curve
            s.setsockopt(zmq.CURVE_SECRETKEY, pair.secret)
            s.setsockopt(zmq.CURVE_PUBLICKEY, pair.public)
            s.setsockopt(zmq.CURVE_SERVERKEY, server_public)
        s.connect(endpoint)
        s.send_multipart(P.encode(msg))
        if s.poll(int(wait_s * 1000), zmq.POLLIN):
            return s.recv_multipart()
        return None
    finally:
        ctx.destroy(linger=0)


def decode_all(frames: list) -> list:
    """The messages in a reply (the broker may pack several into one BATCH message)."""
    if frames[0] == P.BATCH_TYPE:
        return [P.decode(m, max_payload_frames=1)[0] for m in P.split_batch(frames)]
    return [P.decode(frames, max_payload_frames=1)[0]]


# ------------------------------------------------------------------ wire capture

SNIFFER = r"""
import signal, socket, struct, sys
flows = {}  # (src, sport, dst, dport) -> {seq: payload}
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # every interface here
s.settimeout(0.2)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
print("ready", flush=True)
while not stop:
    try:
        frame, addr = s.recvfrom(65536)
    except (socket.timeout, InterruptedError):
        continue
    if addr[2] == socket.PACKET_OUTGOING or frame[12:14] != b"\x08\x00":
        continue  # each frame once (on the port it entered the switch by); IPv4 only
    ip = frame[14:]
    ihl = (ip[0] & 15) * 4
    if ip[9] != 6:
        continue
    total = struct.unpack("!H", ip[2:4])[0]
    tcp = ip[ihl:total]
    off = (tcp[12] >> 4) * 4
    data = bytes(tcp[off:])
    if not data:
        continue
    key = (socket.inet_ntoa(ip[12:16]), struct.unpack("!H", tcp[0:2])[0],
           socket.inet_ntoa(ip[16:20]), struct.unpack("!H", tcp[2:4])[0])
    flows.setdefault(key, {})[struct.unpack("!I", tcp[4:8])[0]] = data
with open(sys.argv[1], "wb") as f:
    for (src, sp, dst, dp), segs in flows.items():
        body = b"".join(segs[k] for k in sorted(segs))  # no wrap-around in a short test
        head = f"{src} {sp} {dst} {dp} {len(body)}\n".encode()
        f.write(head + body)
"""


def read_capture(path: Path) -> dict[tuple[str, int, str, int], bytes]:
    data = path.read_bytes()
    flows, i = {}, 0
    while i < len(data):
        nl = data.index(b"\n", i)
        src, sp, dst, dp, n = data[i:nl].decode().split()
        flows[(src, int(sp), dst, int(dp))] = data[nl + 1 : nl + 1 + int(n)]
        i = nl + 1 + int(n)
    return flows


def zmtp_mechanism(stream: bytes) -> str | None:
    """The security mechanism a ZMTP 3 peer announced in its greeting, if `stream` starts with one."""
    if len(stream) >= 32 and stream[0] == 0xFF and stream[9] == 0x7F and stream[10] >= 3:
        return stream[12:32].rstrip(b"\0").decode("ascii", "replace")
    return None


# ------------------------------------------------------------------ the test


async def test_broker_encoder_pd_in_separate_network_namespaces(lab, model_dir, tmp_path):
    cli, env = epdq_cli(), child_env()
    keys = tmp_path / "keys"
    r = subprocess.run([*cli, "keygen", str(keys)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    broker_ip, enc_ip, pd_ip = lab.addrs["broker"], lab.addrs["enc"], lab.addrs["pd"]
    broker_addr = f"tcp://{broker_ip}:{PORT}"

    capture = tmp_path / "wire.bin"
    sniffer = lab.spawn("sniffer", "br", [sys.executable, "-c", SNIFFER, str(capture)], env=env)
    for _ in range(300):
        if "ready" in sniffer.log():
            break
        lab.check_alive()
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("sniffer did not start")

    common = ["--broker", broker_addr, "--model", model_dir, "--keys-dir", str(keys)]
    lab.spawn(
        "broker", "broker", [*cli, "broker", "--address", broker_addr, "--keys-dir", str(keys)], env=env
    )
    # a wildcard bind, as in a container: the encoder must advertise the address that routes to the
    # broker (its veth), not 0.0.0.0
    lab.spawn("encoder", "enc", [*cli, "worker", "--role", "encoder", "--node", "host-enc",
                                 "--fetch-bind", "tcp://0.0.0.0:*", *common], env=env)  # fmt: skip
    lab.spawn("pd", "pd", [*cli, "worker", "--role", "pd", "--node", "host-pd", *common], env=env)

    # while the engines load: the reference on one host, and a plaintext broker off loopback
    insecure = lab.spawn("insecure-broker", "broker", [*cli, "broker", "--address", f"tcp://{broker_ip}:{PORT + 1}",
                                                       "--insecure"], env=env, watch=False)  # fmt: skip
    expected = await single_host_reference(model_dir, tmp_path / "reference")
    assert all(expected), expected

    async with AsyncClient(broker_addr, keys_dir=str(keys), timeout=120) as c:
        start = await wait_workers(lab, c, {"encoder": 1, "pd": 1}, START_TIMEOUT_S)
        nodes = {w["role"]: w["node"] for w in start["workers"]}
        assert nodes == {"encoder": "host-enc", "pd": "host-pd"}
        before = start["counters"]
        outs = [
            await c.generate(p, images=ims, max_tokens=MAX_TOKENS, temperature=0.0, route="epd")
            for p, ims in REQUESTS
        ]
        after = (await c.stats())["counters"]

        # token-identical to the single-host colocated engine
        for (prompt, _), out, want in zip(REQUESTS, outs, expected, strict=True):
            assert out.timings.route == "epd"
            assert out.token_ids == want, f"{prompt!r}: across hosts {out.token_ids} != single host {want}"

        # every hand-off took the remote fetch path, and every image was encoded on the encoder host
        n_images = sum(len(ims) for _, ims in REQUESTS)
        assert after["remote_handoffs"] - before["remote_handoffs"] == len(REQUESTS)
        assert after["local_handoffs"] == before["local_handoffs"]
        assert after["encodes_done"] - before["encodes_done"] == n_images
        assert after["requests_completed"] - before["requests_completed"] == len(REQUESTS)

        # the remote fetch went over TCP from the PD host's address to the encoder's veth address
        # (advertised for its wildcard-bound fetch socket); the broker has every host (this client
        # too) connected over the switch
        enc_conns = tcp_connections(lab, "enc")
        listening = [(la, lp) for la, lp, _, _, st in enc_conns if st == LISTEN and la != "127.0.0.1"]
        assert len(listening) == 1 and listening[0][0] == "0.0.0.0", enc_conns  # the fetch socket
        fetch_port = listening[0][1]
        assert (enc_ip, fetch_port, pd_ip, ESTABLISHED) in {
            (la, lp, ra, st) for la, lp, ra, _, st in enc_conns
        }, enc_conns
        peers = {
            ra for la, lp, ra, _, st in tcp_connections(lab, "broker") if lp == PORT and st == ESTABLISHED
        }
        assert {enc_ip, pd_ip, lab.root_addr} <= peers

    # on the wire: CURVE greetings only, and neither the prompt nor the image bytes in clear
    sniffer.popen.terminate()
    sniffer.popen.wait(30)
    lab.procs.remove(sniffer)
    flows = read_capture(capture)
    mechanisms = {k: zmtp_mechanism(v) for k, v in flows.items()}
    greeted = {(k[0], k[2]) for k, mech in mechanisms.items() if mech is not None}
    assert {(lab.root_addr, broker_ip), (enc_ip, broker_ip), (pd_ip, broker_ip), (pd_ip, enc_ip),
            (enc_ip, pd_ip)} <= greeted, sorted(greeted)  # fmt: skip
    assert {mech for mech in mechanisms.values() if mech is not None} == {"CURVE"}, mechanisms
    wire = b"".join(flows.values())
    assert len(wire) > sum(len(im) for _, ims in REQUESTS for im in ims)  # the capture saw the traffic
    for prompt, ims in REQUESTS:
        assert prompt.encode() not in wire
        for im in ims:
            assert im[-256:] not in wire

    # plaintext is refused across hosts: by the client library ...
    with pytest.raises(ConfigError, match="not a loopback address"):
        async with AsyncClient(broker_addr, insecure=True) as c:
            await c.stats(timeout=2.0)
    # ... by the CLI, which will not serve plaintext off loopback ...
    rc = await asyncio.to_thread(insecure.popen.wait, 60)
    assert rc != 0 and "not a loopback address" in insecure.log(), insecure.tail()
    # ... and on the wire: a NULL-mechanism peer gets nothing from the broker or the fetch socket,
    # where a CURVE peer with the cluster's keys gets an answer
    fetch_ep = f"tcp://{enc_ip}:{fetch_port}"
    broker_pub = load_public_key(keys / "broker.key")
    client_pair = load_keypair(keys / "client.key_secret")
    worker_pair = load_keypair(keys / "worker.key_secret")  # encoders serve fetches with it
    bogus_fetch = P.Fetch(7, b"\0" * 16, 1, 0, 16)
    results = await asyncio.gather(
        asyncio.to_thread(raw_request, broker_addr, P.Ping(5), curve=None, wait_s=3.0),
        asyncio.to_thread(raw_request, fetch_ep, bogus_fetch, curve=None, wait_s=3.0),
        asyncio.to_thread(raw_request, broker_addr, P.Ping(6), curve=(client_pair, broker_pub), wait_s=20.0),
        asyncio.to_thread(
            raw_request, fetch_ep, bogus_fetch, curve=(worker_pair, worker_pair.public), wait_s=20.0
        ),
    )
    plain_broker, plain_fetch, curve_broker, curve_fetch = results
    assert plain_broker is None and plain_fetch is None
    assert curve_broker is not None and any(isinstance(m, P.Pong) for m in decode_all(curve_broker))
    assert curve_fetch is not None
    [answer] = decode_all(curve_fetch)
    assert isinstance(answer, P.Fetched) and answer.nonce == 7 and answer.code  # answered: no such entry
    lab.check_alive()
