"""The OpenAI-compatible HTTP gateway, driven by the official `openai` package, on no-op clusters."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import os
import socket
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
import aiohttp  # noqa: E402

from epdq import AsyncClient, BrokerUnavailableError  # noqa: E402
from epdq.broker import BrokerConfig  # noqa: E402
from epdq.cluster import Cluster  # noqa: E402
from epdq.demo import demo_image  # noqa: E402
from epdq.gateway import GatewayConfig, build_server  # noqa: E402
from tests.integration.helpers import noop_spec, wait_stats  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MODEL = "epdq-test"



@contextlib.asynccontextmanager
async def gateway(address: str, *, sndbuf: int = 0, servers: list | None = None, **kw):
    """The gateway on 127.0.0.1 with an ephemeral port, in this event loop; yields its base URL.
    `sndbuf`: the send buffer of its connections (they inherit it from the listening socket);
    `servers`: a list the uvicorn server is appended to (its app is `server.config.app`)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    cfg = GatewayConfig(address, host="127.0.0.1", port=port, model_name=MODEL, log_level="warning", **kw)
    server = build_server(cfg)
    if servers is not None:
        servers.append(server)
    server.config.install_signal_handlers = False  # older uvicorn; newer ones only capture inside serve()
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        end = time.monotonic() + 20
        while not server.started:
            if task.done():
                task.result()
                raise AssertionError("gateway exited before starting")
            assert time.monotonic() < end, "gateway did not start"
            await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), 10)
        if not task.done():
            server.force_exit = True
            task.cancel()
        sock.close()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_message(url: str, text: str = "Describe it.") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
        }
    ]



async def test_chat_completions_with_openai_client(tmp_path):
    allow = tmp_path / "images"
    allow.mkdir()
    png = demo_image(1, (64, 64))
    (allow / "cat.png").write_bytes(png)
    (tmp_path / "secret.png").write_bytes(png)
    os.symlink(tmp_path / "secret.png", allow / "escape.png")

    async with (
        Cluster(noop_spec(tmp_path)) as cluster,
        gateway(cluster.address, allow_dir=str(allow), max_body_bytes=2**20) as base,
    ):
        oa = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
        try:
            # streaming, multimodal, with a data: URL
            stream = await oa.chat.completions.create(
                model=MODEL, messages=image_message(data_url(png)), max_tokens=5, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            text, finishes, usage, roles = [], [], None, []
            async for ch in stream:
                assert ch.object == "chat.completion.chunk" and ch.model == MODEL
                if ch.usage is not None:
                    usage = ch.usage
                for c in ch.choices:
                    if c.delta.role:
                        roles.append(c.delta.role)
                    if c.delta.content:
                        text.append(c.delta.content)
                    if c.finish_reason:
                        finishes.append(c.finish_reason)
            streamed = "".join(text)
            assert roles == ["assistant"]
            assert streamed.count("<") == 5, streamed
            assert finishes == ["length"]
            assert usage is not None and usage.completion_tokens == 5
            # the noop engine counts prompt bytes, and the image as its 4 embedding rows (64x64 px)
            assert usage.prompt_tokens > 4 and usage.total_tokens == usage.prompt_tokens + 5

            # non-streaming, same request: same (deterministic) output
            r = await oa.chat.completions.create(
                model=MODEL, messages=image_message(data_url(png)), max_tokens=5
            )
            assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
            assert r.choices[0].message.role == "assistant"
            assert r.choices[0].message.content == streamed
            assert r.choices[0].finish_reason == "length"
            assert r.usage.completion_tokens == 5
            assert (r.usage.prompt_tokens, r.usage.total_tokens) == (usage.prompt_tokens, usage.total_tokens)

            # text-only, string content, max_completion_tokens, stop as a string, seed
            r = await oa.chat.completions.create(
                model=MODEL, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                max_completion_tokens=3, stop="\n\n", seed=7, temperature=0,
            )  # fmt: skip
            assert r.usage.completion_tokens == 3

            # a local file under the allow-listed directory (plain relative path and file:// URL)
            r1 = await oa.chat.completions.create(
                model=MODEL, messages=image_message("cat.png"), max_tokens=5
            )
            r2 = await oa.chat.completions.create(
                model=MODEL, messages=image_message((allow / "cat.png").as_uri()), max_tokens=5
            )
            assert r1.choices[0].message.content == r2.choices[0].message.content == streamed

            # models
            models = await oa.models.list()
            assert [m.id for m in models.data] == [MODEL]

            # bad inputs -> 400
            with pytest.raises(openai.BadRequestError):  # valid base64, not an image
                await oa.chat.completions.create(
                    model=MODEL, messages=image_message(data_url(b"not an image at all")), max_tokens=2
                )
            with pytest.raises(openai.BadRequestError):  # same, streaming
                await oa.chat.completions.create(
                    model=MODEL, messages=image_message(data_url(b"not an image")), max_tokens=2, stream=True
                )
            with pytest.raises(openai.BadRequestError):
                await oa.chat.completions.create(
                    model=MODEL, messages=image_message("data:image/png;base64,@@@"), max_tokens=2
                )
            for outside in (
                str(tmp_path / "secret.png"),
                "../secret.png",
                "escape.png",
                (tmp_path / "secret.png").as_uri(),
                "/etc/passwd",
            ):
                with pytest.raises(openai.BadRequestError) as ei:
                    await oa.chat.completions.create(
                        model=MODEL, messages=image_message(outside), max_tokens=2
                    )
                assert ei.value.status_code == 400
            with pytest.raises(openai.BadRequestError, match="remote image URLs are disabled"):
                await oa.chat.completions.create(
                    model=MODEL, messages=image_message("https://example.invalid/cat.png"), max_tokens=2
                )
            with pytest.raises(openai.BadRequestError):
                await oa.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=0
                )
            with pytest.raises(openai.BadRequestError):
                await oa.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
            with pytest.raises(openai.NotFoundError):
                await oa.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
        finally:
            await oa.close()

        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/health") as resp:
                assert resp.status == 200
                h = await resp.json()
                assert (
                    h["status"] == "ok" and h["workers"].get("encoder") == 1 and h["workers"].get("pd") == 1
                )
                assert "gauges" not in h  # the broker's queue and cache figures are not for API users
            async with http.post(f"{base}/v1/chat/completions", data=b"{not json") as resp:
                assert resp.status == 400
                body = await resp.json()
                assert set(body["error"]) >= {"message", "type", "code"}
            big = b'{"model": "' + b"x" * (2 * 2**20) + b'"}'
            async with http.post(f"{base}/v1/chat/completions", data=io.BytesIO(big)) as resp:
                assert resp.status == 413
            # unknown fields are ignored, and so are OpenAI parameters at their neutral values
            payload = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 2,
                "logit_bias": {},
                "user": "u",
                "logprobs": False,
                "frequency_penalty": 0,
                "presence_penalty": 0.0,
                "tool_choice": "auto",
                "function_call": "none",
                "response_format": {"type": "text"},
                "modalities": ["text"],
            }
            async with http.post(f"{base}/v1/chat/completions", json=payload) as resp:
                assert resp.status == 200, await resp.text()
            # parameters that would change the answer are refused, not silently dropped
            for extra, named in [
                ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
                ({"frequency_penalty": 0.5}, "frequency_penalty"),
                ({"logit_bias": {"42": 5}}, "logit_bias"),
                ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                ({"response_format": {"type": "json_object"}}, "response_format"),
                ({"tool_choice": "required"}, "tool_choice"),
                ({"n": 2}, "n "),
            ]:
                async with http.post(f"{base}/v1/chat/completions", json={**payload, **extra}) as resp:
                    assert resp.status == 400, extra
                    err = (await resp.json())["error"]
                    assert err["code"] == "unsupported_parameter" and err["message"].startswith(named), err
            # an unknown content part is named as such (not "content: should be a string")
            audio = {**payload, "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}
            async with http.post(f"{base}/v1/chat/completions", json=audio) as resp:
                assert resp.status == 400
                msg = (await resp.json())["error"]["message"]
                assert "input_audio" in msg and "messages.0.content.0" in msg, msg

            # the gateway's own metrics saw all of the above
            async with http.get(f"{base}/metrics") as resp:
                assert resp.status == 200 and resp.content_type == "text/plain"
                text = await resp.text()
            m = {}
            for line in text.splitlines():
                if line and not line.startswith("#"):
                    name, value = line.rsplit(" ", 1)
                    m[name] = float(value)
            req = "epdq_gateway_requests_total"
            assert m[f'{req}{{code="200",mode="stream"}}'] == 1
            assert m[f'{req}{{code="200",mode="unary"}}'] == 5
            assert m[f'{req}{{code="400",mode="unary"}}'] >= 9 and m[f'{req}{{code="400",mode="stream"}}'] == 1
            assert m[f'{req}{{code="404",mode="unary"}}'] == 1 and m[f'{req}{{code="413",mode="unary"}}'] == 1
            assert m["epdq_gateway_in_flight"] == 0
            assert m["epdq_gateway_completion_tokens_total"] == 5 + 5 + 3 + 5 + 5 + 2
            assert m["epdq_gateway_prompt_tokens_total"] >= 6 * 4  # six answered requests, each > 4
            assert m["epdq_gateway_images_total"] >= 4
            assert m["epdq_gateway_ttft_seconds_count"] == 6 and m["epdq_gateway_request_seconds_count"] >= 6
            assert m['epdq_gateway_ttft_seconds_bucket{le="+Inf"}'] == 6

    # the broker is gone: /health says 503
    async with gateway(f"ipc://{tmp_path}/sock/nobody") as base, aiohttp.ClientSession() as http:
        async with http.get(f"{base}/health") as resp:
            assert resp.status == 503


async def gateway_metrics(http, base: str) -> dict[str, float]:
    async with http.get(f"{base}/metrics") as resp:
        text = await resp.text()
    return {n: float(v) for n, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln and not ln.startswith("#"))}


async def test_busy_is_429_and_disconnect_cancels(tmp_path):
    """Capacity 1, queue 1: a third request gets 429 with Retry-After; a client that goes away
    mid-stream cancels its request upstream."""
    spec = noop_spec(
        tmp_path, broker=BrokerConfig(max_queued_requests=1, busy_retry_after_s=0.25),
        worker_defaults={"engine": "noop", "capacity": 1, "noop_token_s": 30.0},
    )  # fmt: skip
    async with Cluster(spec) as cluster, gateway(cluster.address, stream_prime_s=0.5) as base:
        oa = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        http = aiohttp.ClientSession()
        msg = [{"role": "user", "content": "x"}]
        try:
            # a stream that occupies the only PD slot; its headers come after stream_prime_s
            running = await http.post(
                f"{base}/v1/chat/completions",
                json={"model": MODEL, "messages": msg, "max_tokens": 1, "stream": True},
            )
            assert running.status == 200
            await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == 1)

            # a request that waits past its deadline -> 504
            async with gateway(cluster.address, request_timeout_s=1.0, stream_prime_s=0.2) as base2:
                async with http.post(
                    f"{base2}/v1/chat/completions", json={"model": MODEL, "messages": msg, "max_tokens": 1}
                ) as resp:
                    assert resp.status == 504, await resp.text()
                    assert (await resp.json())["error"]["code"] == "deadline"
                # the same as a stream, whose 200 went out before the deadline: an error event,
                # then [DONE] as vLLM ends it; counted as the 504 it was, not as a 200
                async with http.post(
                    f"{base2}/v1/chat/completions",
                    json={"model": MODEL, "messages": msg, "max_tokens": 1, "stream": True},
                ) as resp:
                    assert resp.status == 200
                    events = [e for e in (await resp.text()).split("\n\n") if e]
                assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "deadline"
                assert events[-1] == "data: [DONE]"
                m = await gateway_metrics(http, base2)
                assert m['epdq_gateway_requests_total{code="504",mode="unary"}'] == 1
                assert m['epdq_gateway_requests_total{code="504",mode="stream"}'] == 1
                assert 'epdq_gateway_requests_total{code="200",mode="stream"}' not in m
            await wait_stats(cluster.address, lambda s: s["gauges"]["requests_queued"] == 0)

            queued = asyncio.create_task(oa.chat.completions.create(model=MODEL, messages=msg, max_tokens=1))
            await wait_stats(cluster.address, lambda s: s["gauges"]["requests_queued"] == 1)

            with pytest.raises(openai.RateLimitError) as ei:
                await oa.chat.completions.create(model=MODEL, messages=msg, max_tokens=1)
            assert ei.value.status_code == 429
            assert ei.value.response.headers["retry-after"] == "1"
            assert ei.value.body["code"] == "busy"
            with pytest.raises(openai.RateLimitError):
                await oa.chat.completions.create(model=MODEL, messages=msg, max_tokens=1, stream=True)

            # both clients go away: the broker drops both requests
            running.close()
            queued.cancel()
            await asyncio.gather(queued, return_exceptions=True)
            await wait_stats(
                cluster.address,
                lambda s: s["gauges"]["requests_running"] == 0 and s["gauges"]["requests_queued"] == 0,
            )
            # the stream whose client left is a 499 (it used to count as a 200); the refused one a 429
            m = await gateway_metrics(http, base)
            assert m['epdq_gateway_requests_total{code="499",mode="stream"}'] == 1
            assert m['epdq_gateway_requests_total{code="429",mode="stream"}'] == 1
            assert 'epdq_gateway_requests_total{code="200",mode="stream"}' not in m

            # unknown paths and methods answer in OpenAI's error shape
            for method, path, status in [("GET", "/v1/completions", 404), ("GET", "/v1/chat/completions", 405)]:
                async with http.request(method, f"{base}{path}") as resp:
                    assert resp.status == status
                    assert (await resp.json())["error"]["type"] == "invalid_request_error"
            # stream_options without stream: a 400, as vLLM and OpenAI answer
            async with http.post(f"{base}/v1/chat/completions", json={
                "model": MODEL, "messages": msg, "stream_options": {"include_usage": True}}) as resp:
                assert resp.status == 400 and "stream_options" in (await resp.json())["error"]["message"]
        finally:
            await http.close()
            await oa.close()


async def test_one_user_filling_the_queue_does_not_lock_other_users_out(tmp_path):
    """The gateway used to be one broker client for all its users, so the broker's share of a full
    queue (queue_share.py) could not tell them apart: one user filling the queue got every other
    user a 429. Users now go over separate connections (here by their OpenAI `user` field)."""
    spec = noop_spec(
        tmp_path, broker=BrokerConfig(max_queued_requests=2, busy_retry_after_s=0.25),
        worker_defaults={"engine": "noop", "capacity": 1, "noop_token_s": 30.0},
    )  # fmt: skip
    servers: list = []
    async with Cluster(spec) as cluster, gateway(cluster.address, share_by="user", servers=servers) as base:
        conns = servers[0].config.app.state.connections
        assert conns.open == 1  # an idle gateway holds one connection
        other = next(u for u in (f"bob-{i}" for i in range(100)) if conns.slot(conns.tenant("127.0.0.1", u))
                     != conns.slot(conns.tenant("127.0.0.1", "alice")))  # fmt: skip
        http = aiohttp.ClientSession()

        async def ask(user: str, text: str) -> tuple[int, dict]:
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1, "user": user}
            async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
                return resp.status, await resp.json()

        try:
            tasks = [asyncio.create_task(ask("alice", "gate"))]
            await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == 1)
            for i in range(2):
                tasks.append(asyncio.create_task(ask("alice", f"queued {i}")))
                await wait_stats(cluster.address, lambda s, n=i + 1: s["gauges"]["requests_queued"] == n)
            status, body = await ask("alice", "one more")
            assert status == 429 and body["error"]["code"] == "busy"  # full, for the user who filled it
            theirs = asyncio.create_task(ask(other, "mine"))
            status, body = await asyncio.wait_for(tasks[2], 10)  # alice's newest made room
            assert status == 429 and "over its share of 1" in body["error"]["message"], body
            s = await wait_stats(cluster.address, lambda s: s["counters"]["share_preemptions"] == 1)
            assert s["gauges"]["requests_queued"] == 2 and not theirs.done() and not tasks[1].done()
            slots = {conns.slot(conns.tenant("127.0.0.1", u)) for u in ("alice", other)}
            assert conns.open == len(slots | {conns.slot("")})  # /health's, alice's and the other's
            # a request that names no user counts against its address
            assert conns.tenant("10.0.0.1", None) == conns.tenant("10.0.0.1", "") == "a:10.0.0.1"
            for t in [*tasks[:2], theirs]:
                t.cancel()
            await asyncio.gather(*tasks, theirs, return_exceptions=True)
        finally:
            await http.close()


def test_bad_gateway_settings_are_refused_before_anything_starts(tmp_path):
    import subprocess
    import sys

    from epdq.cluster import ClusterSpec

    with pytest.raises(ValueError, match="port must be 1..65535"):
        GatewayConfig("ipc:///x", port=70000)  # uvicorn would bind 70000 % 65536 and print 70000
    with pytest.raises(ValueError, match="does not exist or is not a directory"):
        GatewayConfig("ipc:///x", allow_dir=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="share_by must be one of address, user, none, not 'ip'"):
        GatewayConfig("ipc:///x", share_by="ip")
    with pytest.raises(ValueError, match=r"share_connections must be in \[1, 64\]"):
        GatewayConfig("ipc:///x", share_connections=0)
    r = subprocess.run([sys.executable, "-m", "cli.main", "serve-http", "--share-by", "ip"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "--share-by must be one of" in r.stderr, r.stderr[-1500:]
    # `epdq up --http` starts the gateway last: its options are checked before any worker loads
    with pytest.raises(ValueError, match="does not exist or is not a directory"):
        ClusterSpec(address="ipc:///x", http="127.0.0.1:8000", http_options={"allow_dir": str(tmp_path / "missing")})
    # a config the child process refuses is one line in its log, not a traceback
    r = subprocess.run([sys.executable, "-m", "epdq.launch", "gateway", '{"broker_address": "ipc:///x", "port": 0}'],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "invalid configuration: port must be 1..65535" in r.stderr, r.stderr[-1500:]
    assert "Traceback" not in r.stderr


def test_error_mapping():
    from epdq import BusyError, DeadlineExceededError, EngineError, InvalidInputError, WorkerLostError
    from epdq.chat_request import http_error

    e = http_error(BusyError("full", retry_after=2.2))
    assert (e.status, e.headers["Retry-After"], e.body()["error"]["code"]) == (429, "3", "busy")
    assert http_error(InvalidInputError("bad")).status == 400
    assert http_error(DeadlineExceededError("late")).status == 504
    assert http_error(BrokerUnavailableError("gone")).status == 503
    assert http_error(WorkerLostError("lost")).status == 502
    assert http_error(EngineError("boom")).status == 500
    assert http_error(RuntimeError("x")).status == 500


@contextlib.asynccontextmanager
async def image_server(png: bytes):
    """An HTTP server on 127.0.0.1 with /cat.png, /hop/N (redirects N times, then to cat.png)."""
    from aiohttp import web

    async def cat(_request):
        return web.Response(body=png, content_type="image/png")

    async def hop(request):
        n = int(request.match_info["n"])
        raise web.HTTPFound("/cat.png" if n <= 1 else f"/hop/{n - 1}")

    async def slow(_request):
        await asyncio.sleep(0.5)
        return web.Response(body=png, content_type="image/png")

    app = web.Application()
    app.router.add_get("/cat.png", cat)
    app.router.add_get("/hop/{n}", hop)
    app.router.add_get("/slow.png", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def test_remote_image_urls_reach_public_addresses_only(tmp_path):
    """--allow-remote-urls must not let a client make the gateway fetch from the services beside
    it (loopback, private networks, cloud metadata) unless --allow-private-urls says so."""
    png = demo_image(5, (64, 64))
    async with Cluster(noop_spec(tmp_path)) as cluster, image_server(png) as port:
        async with gateway(cluster.address, allow_remote_urls=True) as base, aiohttp.ClientSession() as http:
            for url in [f"http://127.0.0.1:{port}/cat.png", f"http://localhost:{port}/cat.png",
                        f"http://[::ffff:127.0.0.1]:{port}/cat.png", "http://169.254.169.254/latest/meta-data/",
                        "http://10.1.2.3/x.png",
                        # IPv6 forms that carry an IPv4 address (NAT64, 6to4, IPv4-compatible), and
                        # multicast: they passed as global
                        f"http://[64:ff9b::7f00:1]:{port}/cat.png", "http://[2002:7f00:1::]/x.png",
                        "http://[::127.0.0.1]/x.png", "http://224.0.0.1/x.png"]:  # fmt: skip
                body = {"model": MODEL, "messages": image_message(url), "max_tokens": 2}
                async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
                    err = (await resp.json())["error"]
                    assert resp.status == 400 and err["code"] == "url_not_allowed", (url, err)
                    assert "does not resolve to a public address" in err["message"]
                    assert "127.0.0.1 does" not in err["message"] or url.startswith("http://127.0.0.1")
        async with gateway(cluster.address, allow_remote_urls=True, allow_private_urls=True) as base:
            oa = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
            try:
                direct = await oa.chat.completions.create(
                    model=MODEL, messages=image_message(f"http://localhost:{port}/cat.png"), max_tokens=4
                )
                inline = await oa.chat.completions.create(model=MODEL, messages=image_message(data_url(png)), max_tokens=4)
                assert direct.choices[0].message.content == inline.choices[0].message.content  # same image
                hops = await oa.chat.completions.create(
                    model=MODEL, messages=image_message(f"http://127.0.0.1:{port}/hop/3"), max_tokens=4
                )
                assert hops.choices[0].message.content == inline.choices[0].message.content
                with pytest.raises(openai.BadRequestError, match="redirected more than 3 times"):
                    await oa.chat.completions.create(
                        model=MODEL, messages=image_message(f"http://127.0.0.1:{port}/hop/4"), max_tokens=4
                    )
            finally:
                await oa.close()


async def test_unary_ttft_counts_from_when_the_request_arrived(tmp_path):
    """A unary request's TTFT was the broker client's (from submission), a stream's from receipt:
    the time spent fetching a slow image went missing from one of the two."""
    png = demo_image(6, (64, 64))
    async with Cluster(noop_spec(tmp_path)) as cluster, image_server(png) as port:
        async with gateway(cluster.address, allow_remote_urls=True, allow_private_urls=True) as base:
            async with aiohttp.ClientSession() as http:
                body = {"model": MODEL, "messages": image_message(f"http://127.0.0.1:{port}/slow.png"), "max_tokens": 2}
                for stream in (False, True):
                    async with http.post(f"{base}/v1/chat/completions", json=body | {"stream": stream}) as resp:
                        assert resp.status == 200
                        await resp.read()
                m = await gateway_metrics(http, base)
    assert m["epdq_gateway_ttft_seconds_count"] == 2
    assert m['epdq_gateway_ttft_seconds_bucket{le="0.5"}'] == 0  # both waited for the image


async def test_health_is_503_while_the_broker_drains(tmp_path):
    """A draining broker refuses every request (429): the gateway's /health must take it out of a
    load balancer's rotation then, as the broker's own /health does. It used to stay 200."""
    import signal

    spec = noop_spec(tmp_path, worker_defaults={"engine": "noop", "noop_token_s": 30.0})
    async with Cluster(spec) as cluster, gateway(cluster.address) as base, aiohttp.ClientSession() as http:
        async with http.get(f"{base}/health") as resp:
            assert resp.status == 200 and (await resp.json())["status"] == "ok"
        async with AsyncClient(cluster.address) as c:
            holding = asyncio.create_task(c.generate("hold the drain", max_tokens=2))
            await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == 1)
            cluster.child("broker").proc.send_signal(signal.SIGTERM)
            await wait_stats(cluster.address, lambda s: s["gauges"]["broker_draining"] == 1)
            async with http.get(f"{base}/health") as resp:
                body = await resp.json()
                assert resp.status == 503 and body["status"] == "draining", body
            holding.cancel()
            await asyncio.gather(holding, return_exceptions=True)


async def test_hostile_bodies_are_refused_cheaply_and_typed(tmp_path, caplog):
    """Found by attacking the gateway: each used to cost memory, a 500, or reads it never needed."""
    caplog.set_level(logging.ERROR)
    allow = tmp_path / "imgs"
    allow.mkdir()
    (allow / "cat.png").write_bytes(demo_image(7, (64, 64)))
    async with Cluster(noop_spec(tmp_path)) as cluster:
        async with gateway(cluster.address, allow_dir=str(allow), body_timeout_s=0.5) as base:
            port = int(base.rsplit(":", 1)[1])
            async with aiohttp.ClientSession() as http:

                async def post(raw: bytes) -> tuple[int, dict]:
                    async with http.post(f"{base}/v1/chat/completions", data=io.BytesIO(raw),
                                         headers={"Content-Type": "application/json"}) as resp:  # fmt: skip
                        return resp.status, await resp.json()

                # a million empty parts: a million validation errors (GBs, seconds of a blocked loop)
                raw = b'{"model":"%s","messages":[{"role":"user","content":[' % MODEL.encode()
                status, body = await post(raw + b",".join([b"{}"] * 1_000_000) + b"]}]}")
                assert status == 400 and "at most 128 items" in body["error"]["message"], body
                # 100 image parts naming one file: refused before reading it 100 times
                part = {"type": "image_url", "image_url": {"url": "cat.png"}}
                body = {"model": MODEL, "messages": [{"role": "user", "content": [part] * 100}]}
                async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 400 and "100 images (limit 8" in (await resp.json())["error"]["message"]
                # a bracketed host urllib cannot parse: it was a plain-text 500
                body = {"model": MODEL, "messages": image_message("http://[::1/x.png")}
                async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 400 and "malformed image URL" in (await resp.json())["error"]["message"]
                # a 20 MiB model name is not echoed whole
                status, body = await post(b'{"model":"' + b"A" * 100_000 + b'","messages":[{"role":"user","content":"x"}]}')
                assert status == 404 and len(body["error"]["message"]) < 300

            # a body that never arrives: 408 after body_timeout_s (the connection was held for ever)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{")  # fmt: skip
            await writer.drain()
            assert (await asyncio.wait_for(reader.readline(), 10)).startswith(b"HTTP/1.1 408")
            writer.close()
            # a client that leaves mid-body: 499, not a 500 with a traceback
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            await writer.drain()
            writer.close()
            async with aiohttp.ClientSession() as http:
                m = {}
                for _ in range(100):
                    m = await gateway_metrics(http, base)
                    if m.get('epdq_gateway_requests_total{code="499",mode="unary"}'):
                        break
                    await asyncio.sleep(0.05)
                assert m.get('epdq_gateway_requests_total{code="499",mode="unary"}') == 1, m
                assert not m.get('epdq_gateway_requests_total{code="500",mode="unary"}')
    # nor a traceback at ERROR (uvicorn's "Exception in ASGI application"): any client could fill the log
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_stream_nobody_reads_is_cancelled_not_buffered(tmp_path, caplog):
    """The gateway queued every delta for a client that read nothing (8 MB per long stream, held
    until the socket closed) and counted the request as a 200 when upstream finished. Then it
    cancelled upstream but still waited, with no limit, to write to that client: the connection,
    its task and one of the 2,048 slots (beyond them: 503 to everyone) stayed until it closed."""
    caplog.set_level(logging.ERROR)
    spec = noop_spec(tmp_path, worker_defaults={"engine": "noop", "noop_token_s": 0.002})  # 65 s for all
    servers: list = []
    # small socket buffers on both ends: the kernel must not absorb what the client does not read
    async with (
        Cluster(spec) as cluster,
        gateway(cluster.address, stream_stall_s=1.0, sndbuf=4096, servers=servers) as base,
    ):
        port = int(base.rsplit(":", 1)[1])
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 32768,
                           "stream": True}).encode()  # fmt: skip
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1024)
        try:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            await writer.drain()
            reader._transport.pause_reading()  # read nothing more
            async with aiohttp.ClientSession() as http:
                m: dict = {}
                for _ in range(200):
                    m = await gateway_metrics(http, base)
                    if m.get('epdq_gateway_requests_total{code="499",mode="stream"}'):
                        break
                    await asyncio.sleep(0.05)
            assert m.get('epdq_gateway_requests_total{code="499",mode="stream"}') == 1, m
            s = await wait_stats(cluster.address, lambda s: s["gauges"]["requests_running"] == 0, timeout=10)
            assert s["counters"]["cancelled"] == 1  # upstream was cancelled, not run to 32,768 tokens
            # the gateway let go of the connection while the client still holds it, reading nothing
            state = servers[0].server_state
            for _ in range(100):
                if not state.connections and not state.tasks:
                    break
                await asyncio.sleep(0.05)
            assert (len(state.connections), len(state.tasks)) == (0, 0)
            # aborted, not closed gracefully (that waits to flush to this very client): what the kernel
            # held comes, then the end, without the stream's last chunk
            reader._transport.resume_reading()
            got = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := await asyncio.wait_for(reader.read(65536), 10):
                    got += chunk
            assert got.startswith(b"HTTP/1.1 200") and not got.endswith(b"0\r\n\r\n")
        finally:
            writer.close()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_stream_that_fails_with_its_first_delta_is_counted_as_its_error(monkeypatch):
    """A first delta and an error at once: the pump ended during the wait for a first answer, and
    the 200 of the status line overwrote the 502 it had recorded."""
    import epdq.client
    from epdq import WorkerLostError
    from epdq.client import Delta

    class FailingAfterOne:
        def __init__(self, *_a, **_kw):
            pass

        async def connect(self):
            pass

        async def close(self):
            pass

        async def stream(self, **_kw):
            yield Delta("a", [1], None, "up-1")
            raise WorkerLostError("the PD worker died after the first token")

    monkeypatch.setattr(epdq.client, "AsyncClient", FailingAfterOne)
    async with gateway("ipc:///nowhere") as base, aiohttp.ClientSession() as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
        async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200  # the first delta came: the status line is a 200
            events = [e for e in (await resp.text()).split("\n\n") if e]
        assert json.loads(events[1].removeprefix("data: "))["choices"][0]["delta"]["content"] == "a"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "worker_lost"
        m = await gateway_metrics(http, base)
    assert m['epdq_gateway_requests_total{code="502",mode="stream"}'] == 1, m
    assert 'epdq_gateway_requests_total{code="200",mode="stream"}' not in m


async def test_a_large_image_goes_through_the_threads_and_matches_the_client(tmp_path):
    """A body over 1 MiB is parsed, and a data: URL over 64 KiB decoded, on threads (they used to
    stall every stream of the gateway's loop): the answer is the one the client gets directly."""
    from epdq import gateway as gw
    from epdq import media

    png = demo_image(9, (64, 64)) + os.urandom(1 << 20)  # trailing bytes after IEND: a large file
    url = data_url(png)
    assert len(url) > gw.PARSE_INLINE_BYTES and len(url) > media.LOAD_INLINE_BYTES
    async with Cluster(noop_spec(tmp_path)) as cluster, gateway(cluster.address) as base:
        async with aiohttp.ClientSession() as http:
            def post(body: dict):
                # a BytesIO: aiohttp's JsonPayload refuses bodies this large
                raw = io.BytesIO(json.dumps(body).encode())
                return http.post(f"{base}/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})

            body = {"model": MODEL, "messages": image_message(url, "x"), "max_tokens": 4}
            async with post(body) as resp:
                assert resp.status == 200, await resp.text()
                got = (await resp.json())["choices"][0]["message"]["content"]
            bad = {"model": MODEL, "messages": image_message(url[:-8] + "!!!!!!!!", "x")}
            async with post(bad) as resp:
                assert resp.status == 400 and "invalid base64" in (await resp.json())["error"]["message"]
        async with AsyncClient(cluster.address) as c:
            want = await c.generate(messages=image_message(url, "x"), max_tokens=4)
        assert got == want.text and got.count("<") == 4
