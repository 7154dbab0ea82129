"""`epdq up --http H:P --metrics H:P`: the gateway could not bind the port the broker's metrics
endpoint held, yet `up` took the broker's /health there for the gateway's, said "epdq is up ...
OpenAI-compatible API", and the gateway crash-looped behind it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess

import pytest
from typer.testing import CliRunner

from epdq.cluster import Child, Cluster, ClusterSpec

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("http", "metrics"),
    [
        ("127.0.0.1:18123", "127.0.0.1:18123"),
        ("0.0.0.0:18123", "127.0.0.1:18123"),
        ("localhost:18123", "127.0.0.1:18123"),
        ("127.0.0.1:18123", "[::]:18123"),
        ("[::1]:18123", "[::1]:18123"),
    ],
)
def test_http_and_metrics_on_one_listener_are_refused(http, metrics, tmp_path):
    with pytest.raises(ValueError, match="http and metrics cannot both listen on"):
        ClusterSpec(address=f"ipc://{tmp_path}/b.sock", http=http, metrics=metrics)


@pytest.mark.parametrize(
    ("http", "metrics"), [("127.0.0.1:18123", "127.0.0.1:18124"), ("127.0.0.1:18123", "127.0.0.2:18123")]
)
def test_http_and_metrics_on_different_listeners_are_fine(http, metrics, tmp_path):
    pytest.importorskip("fastapi")
    ClusterSpec(address=f"ipc://{tmp_path}/b.sock", http=http, metrics=metrics)


def test_up_refuses_them_before_anything_starts(tmp_path):
    from cli.main import app

    res = CliRunner().invoke(app, ["up", "--address", f"ipc://{tmp_path}/b.sock", "--log-dir", str(tmp_path / "logs"),
                                   "--http", "127.0.0.1:18123", "--metrics", "127.0.0.1:18123"])  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "http and metrics cannot both listen on 127.0.0.1:18123" in " ".join(res.output.replace("│", " ").split())
    assert not (tmp_path / "logs").exists()


@contextlib.asynccontextmanager
async def http_server(answers: dict[str, tuple[int, bytes]]):
    """A server on loopback answering GET path with answers[path], else 404 (the broker's metrics
    endpoint answers /health and /metrics only)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            path = (await reader.readline()).split()[1].decode()
            while (await reader.readline()) not in (b"\r\n", b""):
                pass
            status, body = answers.get(path, (404, b"not found\n"))
            writer.write(f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            await writer.drain()
        finally:
            writer.close()
            await writer.wait_closed()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


def cluster_with_gateway(tmp_path, port: int, script: str) -> Cluster:
    cluster = Cluster(ClusterSpec(address=f"ipc://{tmp_path}/b.sock", log_dir=str(tmp_path), start_timeout_s=20))
    log = tmp_path / "gateway.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(["sh", "-c", script], stdout=out, stderr=subprocess.STDOUT)
    cluster.children.append(Child("gateway", proc, log, 0, "gateway"))
    return cluster


async def test_the_brokers_health_on_the_gateways_port_is_not_taken_for_the_gateway(tmp_path):
    async with http_server({"/health": (200, b"ok\n"), "/metrics": (200, b"")}) as port:
        cluster = cluster_with_gateway(tmp_path, port, "echo 'cannot serve HTTP: Address already in use'; sleep 1; exit 2")
        try:
            with pytest.raises(RuntimeError, match="gateway exited with code 2") as ei:
                await cluster._wait_http("127.0.0.1", port)
            assert "Address already in use" in str(ei.value)
        finally:
            cluster.stop()


async def test_the_gateway_is_ready_once_it_answers_health_and_lists_its_models(tmp_path):
    models = json.dumps({"object": "list", "data": [{"id": "epdq", "object": "model"}]}).encode()
    async with http_server({"/health": (200, b"{}"), "/v1/models": (200, models)}) as port:
        cluster = cluster_with_gateway(tmp_path, port, "sleep 30")
        try:
            await asyncio.wait_for(cluster._wait_http("127.0.0.1", port), 10)
        finally:
            cluster.stop(timeout=1)


@pytest.mark.parametrize(
    ("flags", "says"),
    [(["--max-model-len", "8"], "--max-model-len must be in"), (["--kv-cache-mb", "-1"], "--kv-cache-mb (in bytes) must be")],
)
def test_up_checks_the_llm_engines_settings_before_anything_starts(tmp_path, flags, says):
    from cli.main import app

    res = CliRunner().invoke(app, ["up", "--address", f"ipc://{tmp_path}/b.sock", "--log-dir", str(tmp_path / "logs"), *flags])
    assert res.exit_code == 2, res.output
    assert says in " ".join(res.output.replace("│", " ").split())
    assert not (tmp_path / "logs").exists()


def test_up_gives_the_llm_engines_settings_to_pd_and_colocated_workers_only(tmp_path):
    from epdq.cluster import Cluster

    spec = ClusterSpec(address=f"ipc://{tmp_path}/b.sock", encoders=1, pds=1, both=1,
                       worker_defaults={"max_model_len": 8192, "kv_cache_bytes": 512 << 20})  # fmt: skip
    cfgs = dict(Cluster(spec).worker_configs())
    assert cfgs["pd-0"].kv_cache_bytes == cfgs["both-0"].kv_cache_bytes == 512 << 20
    assert cfgs["encoder-0"].kv_cache_bytes == 0
    assert {c.max_model_len for c in cfgs.values()} == {8192}
