"""The HTTP baseline of the control-plane benchmark, shaped like vLLM's disaggregated-encoder proxy.

Three uvicorn servers, each in its own process:

- a no-op **encoder** server: `POST /encode` parses the JSON body and answers at once;
- a no-op **PD** server: `POST /v1/chat/completions` parses the JSON body and returns a tiny
  OpenAI-style completion;
- a FastAPI **proxy**: for each chat request it builds one encoder request per image item (text
  removed), sends them concurrently with aiohttp, waits for all of them, then forwards the
  original request to the PD server and returns its answer (the request flow of vLLM's
  `examples/online_serving/disaggregated_encoder/disagg_epd_proxy.py`).

The proxy serves two variants side by side, so one process covers both:
`/v1/chat/completions` opens a new upstream connection per call (vLLM's connector settings:
no connection limit, keep-alive timeout 0), `/keepalive/v1/chat/completions` reuses pooled
keep-alive connections.

`python -m epdq.benchmarks.http_proxy encoder|pd|proxy --port N [--encoder URL --pd URL]` runs one
server; `HttpBaseline` starts all three as child processes and stops them (terminate, then kill).

No `from __future__ import annotations` here: FastAPI resolves handler annotations (`Request`)
at definition time, and the handlers are defined inside factory functions.
"""

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

MM_TYPES = ("image_url", "audio_url", "input_audio")
NEW_CONNECTION_PATH = "/v1/chat/completions"
KEEPALIVE_PATH = "/keepalive/v1/chat/completions"


def _json_response(data: Any):
    from fastapi import Response

    return Response(content=json.dumps(data, separators=(",", ":")), media_type="application/json")


# ------------------------------------------------------------------ no-op backends


def encoder_app():
    from fastapi import FastAPI, Request

    app = FastAPI()

    @app.get("/health")
    async def health():
        return _json_response({"status": "ok"})

    @app.post("/encode")
    async def encode(request: Request):
        body = await request.json()
        items = sum(
            1
            for m in body.get("messages", ())
            if isinstance(m.get("content"), list)
            for p in m["content"]
            if p.get("type") in MM_TYPES
        )
        return _json_response({"status": "ok", "items": items})

    return app


def pd_app():
    from fastapi import FastAPI, Request

    app = FastAPI()

    @app.get("/health")
    async def health():
        return _json_response({"status": "ok"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        return _json_response(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "noop"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "<7>"},
                        "finish_reason": "length",
                    }
                ],
                "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
            }
        )

    return app


# ------------------------------------------------------------------ the proxy


def mm_items(req: dict) -> list[tuple[str, dict]]:
    """(role, content part) of every multimodal item in an OpenAI chat request."""
    out = []
    for m in req.get("messages", ()):
        content = m.get("content")
        if isinstance(content, list):
            out.extend((m.get("role", "user"), p) for p in content if p.get("type") in MM_TYPES)
    return out


def encoder_requests(req: dict) -> list[dict]:
    """One request per multimodal item, with all text removed and max_tokens 1."""
    base = {k: v for k, v in req.items() if k not in ("messages", "stream_options")}
    base.update(max_tokens=1, stream=False)
    return [{**base, "messages": [{"role": role, "content": [part]}]} for role, part in mm_items(req)]


def proxy_app(encoder_url: str, pd_url: str):
    import aiohttp
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import JSONResponse

    sessions: dict[str, aiohttp.ClientSession] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        timeout = aiohttp.ClientTimeout(total=600)
        # vLLM's settings: unlimited connections, keep-alive timeout 0 -> a new connection per call
        sessions["new"] = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=0)
        )
        sessions["keepalive"] = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        )
        try:
            yield
        finally:
            for s in sessions.values():
                await s.close()

    app = FastAPI(lifespan=lifespan)

    async def encode_one(session: aiohttp.ClientSession, body: dict, rid: str) -> None:
        async with session.post(f"{encoder_url}/encode", json=body, headers={"x-request-id": rid}) as resp:
            if resp.status != 200:
                raise HTTPException(status_code=502, detail=f"encoder answered {resp.status}")
            await resp.read()

    async def forward(session: aiohttp.ClientSession, request: Request):
        req = await request.json()
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        jobs = encoder_requests(req)
        if jobs:
            await asyncio.gather(*(encode_one(session, j, rid) for j in jobs))
        async with session.post(
            f"{pd_url}/v1/chat/completions", json=req, headers={"x-request-id": rid}
        ) as resp:
            if resp.status != 200:
                raise HTTPException(status_code=502, detail=f"PD server answered {resp.status}")
            result = await resp.json()
        return JSONResponse(content=result)

    @app.get("/health")
    async def health():
        return _json_response({"status": "ok"})

    @app.post(NEW_CONNECTION_PATH)
    async def chat_new_connection(request: Request):
        return await forward(sessions["new"], request)

    @app.post(KEEPALIVE_PATH)
    async def chat_keepalive(request: Request):
        return await forward(sessions["keepalive"], request)

    return app


# ------------------------------------------------------------------ processes


def serve(role: str, port: int, *, encoder_url: str = "", pd_url: str = "") -> None:
    import uvicorn

    if role == "encoder":
        app = encoder_app()
    elif role == "pd":
        app = pd_app()
    elif role == "proxy":
        app = proxy_app(encoder_url, pd_url)
    else:
        raise ValueError(f"unknown role {role!r}")
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop=loop)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpBaseline:
    """The three servers as child processes. `proxy_url(keepalive)` is where a client posts."""

    def __init__(self, log_dir: str | os.PathLike, *, start_timeout_s: float = 60.0):
        self.log_dir = Path(log_dir)
        self.start_timeout_s = start_timeout_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    def proxy_url(self, keepalive: bool) -> str:
        return self.url("proxy") + (KEEPALIVE_PATH if keepalive else NEW_CONNECTION_PATH)

    def _spawn(self, role: str, *extra: str) -> None:
        from epdq.cluster import die_with_parent  # only the parent needs epdq; the servers don't

        port = free_port()
        self.ports[role] = port
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"http-{role}.log", "ab") as out:
            self.procs[role] = subprocess.Popen(
                [sys.executable, "-m", "epdq.benchmarks.http_proxy", role, "--port", str(port), *extra],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent, start_new_session=True,
            )  # fmt: skip

    def tail(self, role: str, n: int = 30) -> str:
        try:
            lines = (self.log_dir / f"http-{role}.log").read_text(errors="replace").splitlines()
            return "\n".join(lines[-n:])
        except OSError:
            return ""

    def check_alive(self) -> None:
        for role, p in self.procs.items():
            rc = p.poll()
            if rc is not None:
                raise RuntimeError(f"HTTP {role} server exited with code {rc}:\n{self.tail(role)}")

    async def start(self) -> None:
        import aiohttp

        try:
            self._spawn("encoder")
            self._spawn("pd")
            self._spawn("proxy", "--encoder", self.url("encoder"), "--pd", self.url("pd"))
            deadline = time.monotonic() + self.start_timeout_s
            async with aiohttp.ClientSession() as s:
                for role in ("encoder", "pd", "proxy"):
                    while True:
                        self.check_alive()
                        try:
                            async with s.get(self.url(role) + "/health") as r:
                                if r.status == 200:
                                    break
                        except aiohttp.ClientError:
                            pass
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"HTTP {role} server not up after {self.start_timeout_s}s")
                        await asyncio.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 10.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    p.terminate()
        end = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    p.kill()
                p.wait(5)
        self.procs.clear()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m epdq.benchmarks.http_proxy", description=__doc__.split("\n")[0]
    )
    ap.add_argument("role", choices=("encoder", "pd", "proxy"))
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--encoder", default="", help="encoder server URL (proxy only)")
    ap.add_argument("--pd", default="", help="PD server URL (proxy only)")
    a = ap.parse_args(argv)
    if a.role == "proxy" and not (a.encoder and a.pd):
        ap.error("the proxy needs --encoder and --pd")
    serve(a.role, a.port, encoder_url=a.encoder, pd_url=a.pd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
