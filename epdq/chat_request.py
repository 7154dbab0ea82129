"""An OpenAI chat-completions request as the gateway takes it: the schema (pydantic; unknown
fields ignored, OpenAI parameters that epdq cannot honour refused), the resolution of its `image_url` parts into image bytes (data:
URLs always; local files only under `allow_dir`; http(s) only when enabled, size-capped), its
translation into epdq messages and sampling arguments, and the mapping of epdq's typed errors to
HTTP statuses with OpenAI-style bodies."""

from __future__ import annotations

import asyncio
import ipaddress
import math
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import unquote, urlparse

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from epdq.errors import (
    BrokerUnavailableError,
    BusyError,
    DeadlineExceededError,
    EpdqError,
    InvalidInputError,
    WorkerLostError,
)
from epdq.protocol import MAX_MESSAGES, MAX_TOKENS_LIMIT

# Bounds checked by the schema itself, so that a body of a million tiny parts is refused at the
# first one too many instead of producing (and reporting) a million validation errors.
MAX_CONTENT_PARTS = 128  # per message
_ECHO = 100  # characters of a client's value echoed in an error
# characters of pydantic's message in a 400: some quote the client's value whole (a content part's
# unknown `type`: 20 MiB of tag made a 20 MiB answer)
_MESSAGE_CHARS = 300

if TYPE_CHECKING:
    from epdq.gateway import GatewayConfig


# ---------------------------------------------------------------- request schema


class _Model(BaseModel):
    # unknown fields are ignored, as OpenAI does; known ones strictly typed, as OpenAI checks them
    # (`"max_tokens": true` was 1 token, `"stream": 1` a stream, `"temperature": "0.5"` 0.5)
    model_config = ConfigDict(extra="ignore", strict=True)


class ImageURL(_Model):
    url: str
    detail: str | None = None


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImagePart(_Model):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessageIn(_Model):
    role: Literal["system", "developer", "user", "assistant"]
    content: (
        str
        | Annotated[list[Annotated[TextPart | ImagePart, Field(discriminator="type")]], Field(max_length=MAX_CONTENT_PARTS)]
        | None
    ) = None
    name: str | None = None


class StreamOptions(_Model):
    include_usage: bool = False


class ChatCompletionRequest(_Model):
    model: str
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1)
    # who the request is for (OpenAI's field): with --share-by user, whose share of a full queue
    # it counts against; any JSON value is accepted (and ignored unless a string), as before
    user: Any = None
    # OpenAI parameters that would change the answer and that epdq does not implement: declared
    # so that a request using them is refused (see `unsupported`) instead of silently served
    # without them; the rest of OpenAI's unknown fields (metadata, store, ...) are ignored.
    logprobs: bool | None = None
    top_logprobs: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: Any = None


def unsupported(req: ChatCompletionRequest) -> str | None:
    """The first parameter set to something epdq cannot honour, or None."""
    if req.n not in (None, 1):
        return "n (only n=1 is supported)"
    if req.logprobs or req.top_logprobs:
        return "logprobs"
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name):
            return name
    for name in ("logit_bias", "tools", "functions", "prediction"):
        if getattr(req, name):
            return name
    # "auto" without tools asks for nothing: some clients always send it
    if req.tool_choice not in (None, "none", "auto"):
        return "tool_choice"
    if req.function_call not in (None, "none", "auto"):
        return "function_call"
    if req.response_format and req.response_format.get("type", "text") != "text":
        return "response_format"
    if req.modalities and set(req.modalities) != {"text"}:
        return "modalities (text only)"
    return None


def parse_request(raw: bytes) -> ChatCompletionRequest:
    """Validate a request body: a 400 naming the first problem (the deepest location of a
    failed union, where pydantic reports every alternative)."""
    try:
        req = ChatCompletionRequest.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False, include_input=False)  # the input may be megabytes
        if not errors:
            raise bad_request("invalid request") from None
        # a list over its bound says more than the union's other branch ("should be a string")
        first = max(errors, key=lambda err: (err.get("type") == "too_long", len(err.get("loc", ()))))
        where = ".".join(str(x) for x in first.get("loc", ()) if not _union_branch(x))
        msg = str(first.get("msg", "invalid"))
        if len(msg) > _MESSAGE_CHARS:
            msg = msg[:_MESSAGE_CHARS] + "..."
        raise bad_request(f"invalid request: {where}: {msg}") from None
    bad = unsupported(req)
    if bad is not None:
        raise bad_request(f"{bad} is not supported by this server", "unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true")  # as vLLM and OpenAI answer
    return req


def _union_branch(loc: Any) -> bool:
    # pydantic names a union's alternatives in `loc` ("str", "list[...]", "function-after[...]")
    return isinstance(loc, str) and (loc in ("str", "int", "float", "bool", "none") or "[" in loc)


# ---------------------------------------------------------------- errors


class HTTPError(Exception):
    def __init__(
        self, status: int, message: str, type_: str, code: str, headers: dict[str, str] | None = None,
        detail: str = "",
    ):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code
        self.headers = headers or {}
        self.detail = detail or message  # for the gateway's log only: it may name internal addresses

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": None}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, code: str = "invalid_input") -> HTTPError:
    return HTTPError(400, message, "invalid_request_error", code)


def http_error(exc: BaseException) -> HTTPError:
    """The HTTP status and OpenAI-style error for an exception from the client."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, BusyError):
        retry = str(max(1, math.ceil(exc.retry_after)))
        return HTTPError(429, exc.message, "rate_limit_error", exc.code, {"Retry-After": retry})
    if isinstance(exc, InvalidInputError):
        return bad_request(exc.message)
    if isinstance(exc, DeadlineExceededError):
        return HTTPError(504, exc.message, "timeout_error", exc.code)
    if isinstance(exc, BrokerUnavailableError):
        # the broker's address and state are for the operator's log, not for any HTTP client
        return HTTPError(503, "the inference service is unavailable; retry later", "service_unavailable_error",
                         exc.code, {"Retry-After": "1"}, detail=exc.message)  # fmt: skip
    if isinstance(exc, WorkerLostError):
        return HTTPError(502, exc.message, "upstream_error", exc.code)
    if isinstance(exc, EpdqError):
        return HTTPError(500, exc.message, "server_error", exc.code)
    return HTTPError(500, f"internal error: {type(exc).__name__}", "server_error", "internal")


# ---------------------------------------------------------------- images


def read_local_image(ref: str, allow_dir: str, max_bytes: int) -> bytes:
    """Bytes of a local file named by `ref` (a `file://` URL or a path, relative to `allow_dir`),
    only if its real path (symlinks resolved) lies inside `allow_dir` and it is a regular file."""
    if ref[:5].lower() == "file:":
        u = urlparse(ref)
        if u.netloc not in ("", "localhost"):
            raise bad_request("file: URLs must name a local file")
        ref = unquote(u.path)
    if not ref or "\x00" in ref:
        raise bad_request("empty or invalid image path")
    root = Path(os.path.realpath(allow_dir))
    path = Path(os.path.realpath(root / ref))  # an absolute `ref` replaces root
    if not path.is_relative_to(root):
        raise bad_request("image path is outside the allowed directory", "path_not_allowed")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        raise bad_request("image file not found or not readable", "path_not_allowed") from None
    try:
        # checked on the raw fd: os.fdopen itself refuses a directory, and would leak the fd
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise bad_request("image path is not a regular file", "path_not_allowed")
        if st.st_size > max_bytes:
            raise bad_request(f"image file is larger than {max_bytes} bytes")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise bad_request(f"image file is larger than {max_bytes} bytes")
    return data


_REDIRECTS = (301, 302, 303, 307, 308)
MAX_REDIRECTS = 3


class _PrivateAddress(OSError):
    """A remote image URL whose host is (or resolves to) a non-public address."""


def _check_public(host: str, ip_text: str) -> None:
    ip = ipaddress.ip_address(ip_text.split("%", 1)[0])  # drop an IPv6 zone
    # what the address says it is (global) is not enough: IPv6 forms that carry an IPv4 address
    # reach that address through a translator (NAT64's 64:ff9b::/96 to 169.254.169.254, ...)
    if not all(a.is_global and not a.is_multicast for a in (ip, *_embedded_ipv4(ip))):
        # the resolved address stays in the gateway: a client must not map internal names with it
        raise _PrivateAddress(f"{host[:_ECHO]} does not resolve to a public address")


_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


def _embedded_ipv4(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    if ip.version == 4:
        return []
    found = [a for a in (ip.ipv4_mapped, ip.sixtofour, (ip.teredo or (None, None))[1]) if a is not None]
    if any(ip in net for net in (*_NAT64, _IPV4_COMPATIBLE)) or ip.packed[:12] == bytes(8) + b"\xff\xff\x00\x00":
        found.append(ipaddress.IPv4Address(ip.packed[-4:]))  # NAT64, IPv4-compatible, SIIT (::ffff:0:a.b.c.d)
    return found


def _public_resolver() -> Any:
    """An aiohttp resolver that refuses hosts resolving to loopback, private, link-local (cloud
    metadata), shared or reserved addresses. The check is on the addresses the connection then
    uses, so a name that resolves differently the second time (DNS rebinding) cannot slip by."""
    import aiohttp
    from aiohttp.abc import AbstractResolver

    class PublicOnly(AbstractResolver):
        def __init__(self) -> None:
            self._inner = aiohttp.ThreadedResolver()

        async def resolve(self, host: str, port: int = 0, family: int = 0) -> list:
            infos = await self._inner.resolve(host, port, family)
            for info in infos:
                _check_public(host, info["host"])
            return infos

        async def close(self) -> None:
            await self._inner.close()

    return PublicOnly()


async def fetch_remote_image(url: str, cfg: GatewayConfig) -> bytes:
    """Download an http(s) image with a size cap and a timeout (only when remote URLs are
    enabled). Unless `allow_private_urls`, every host on the way (redirects included, followed
    here one by one) must be a public address: a client must not make the gateway reach the
    services beside it (SSRF)."""
    import aiohttp
    from yarl import URL

    connector = aiohttp.TCPConnector(resolver=None if cfg.allow_private_urls else _public_resolver())
    try:
        async with asyncio.timeout(cfg.remote_timeout_s), aiohttp.ClientSession(connector=connector) as s:
            target = URL(url)
            for _ in range(MAX_REDIRECTS + 1):
                if target.scheme not in ("http", "https") or not target.host:
                    raise bad_request("image URLs must be http(s) URLs with a host")
                host = target.host.strip("[]")
                if not cfg.allow_private_urls and _is_ip(host):
                    _check_public(host, host)  # literal addresses never reach the resolver
                async with s.get(target, allow_redirects=False) as r:
                    if r.status in _REDIRECTS and "Location" in r.headers:
                        target = r.url.join(URL(r.headers["Location"]))
                        continue
                    if r.status != 200:
                        raise bad_request(f"fetching the image URL gave HTTP {r.status}")
                    if (r.content_length or 0) > cfg.max_image_bytes:
                        raise bad_request(f"remote image is larger than {cfg.max_image_bytes} bytes")
                    buf = bytearray()
                    async for chunk in r.content.iter_chunked(64 * 1024):
                        buf += chunk
                        if len(buf) > cfg.max_image_bytes:
                            raise bad_request(f"remote image is larger than {cfg.max_image_bytes} bytes")
                    return bytes(buf)
            raise bad_request(f"the image URL redirected more than {MAX_REDIRECTS} times")
    except _PrivateAddress as e:
        raise bad_request(f"image URL refused: {e}", "url_not_allowed") from None
    except aiohttp.ClientConnectorError as e:
        if isinstance(e.os_error, _PrivateAddress):
            raise bad_request(f"image URL refused: {e.os_error}", "url_not_allowed") from None
        raise bad_request(f"could not fetch the image URL: {type(e).__name__}") from None
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        raise bad_request(f"could not fetch the image URL: {type(e).__name__}") from None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True


async def _image_part(url: str, cfg: GatewayConfig) -> dict:
    if url[:5].lower() == "data:":
        return {"type": "image_url", "image_url": {"url": "data:" + url[5:]}}  # decoded and validated by the client
    try:
        scheme = urlparse(url).scheme.lower() if "://" in url or url[:5].lower() == "file:" else ""
    except ValueError as e:  # "http://[::1/": urllib refuses the bracketed host
        raise bad_request(f"malformed image URL: {e}") from None
    if scheme in ("http", "https"):
        if not cfg.allow_remote_urls:
            raise bad_request(
                "remote image URLs are disabled on this server; send a data: URL", "remote_url_disabled"
            )
        return {"type": "image", "image": await fetch_remote_image(url, cfg)}
    if scheme not in ("", "file"):
        raise bad_request(f"unsupported image URL scheme {scheme!r}")
    if cfg.allow_dir is None:
        raise bad_request(
            "local image files are disabled on this server; send a data: URL", "path_not_allowed"
        )
    data = await asyncio.to_thread(read_local_image, url, cfg.allow_dir, cfg.max_image_bytes)
    return {"type": "image", "image": data}


async def to_epdq_messages(req: ChatCompletionRequest, cfg: GatewayConfig) -> list[dict]:
    images = sum(isinstance(p, ImagePart) for m in req.messages if isinstance(m.content, list) for p in m.content)
    if images > cfg.max_images:  # before reading or downloading any of them
        raise bad_request(f"{images} images (limit {cfg.max_images} per request)")
    out: list[dict] = []
    for m in req.messages:
        role = "system" if m.role == "developer" else m.role
        if m.content is None or isinstance(m.content, str):
            out.append({"role": role, "content": m.content or ""})
            continue
        parts: list[dict] = []
        for p in m.content:
            if isinstance(p, TextPart):
                parts.append({"type": "text", "text": p.text})
            else:
                parts.append(await _image_part(p.image_url.url, cfg))
        out.append({"role": role, "content": parts})
    return out


def sampling_kwargs(req: ChatCompletionRequest, cfg: GatewayConfig) -> dict[str, Any]:
    max_tokens = req.max_completion_tokens or req.max_tokens or cfg.default_max_tokens or MAX_TOKENS_LIMIT
    kw: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
    }
    if cfg.request_timeout_s:
        kw["timeout"] = cfg.request_timeout_s  # else the client's default: the broker's --timeout
    if req.seed is not None:
        kw["seed"] = req.seed
    if req.stop is not None:
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if len(stops) > 4 or any(not s for s in stops):
            raise bad_request("stop takes at most 4 non-empty strings")
        kw["stop"] = stops
    return kw
