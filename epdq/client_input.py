"""What a caller hands `AsyncClient`, checked and turned into wire messages: (prompt, images)
or OpenAI-style messages into chat messages and image blobs, and the sampling arguments into
`protocol.Sampling`. Everything a caller passes is refused here with `InvalidInputError`, before
anything is sent.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from epdq import protocol as P
from epdq.errors import InvalidInputError, ProtocolError
from epdq.media import LOAD_INLINE_BYTES, decode_data_url, is_pil_image, load_image_bytes, loads_slowly


def build_messages(
    prompt: str | None, images: Sequence[Any], messages: list[dict] | None
) -> tuple[list[P.ChatMessage], list[bytes]]:
    """Turn (prompt, images) or OpenAI-style messages into wire messages and image blobs.

    Content parts: {"type": "text", "text": ...}; {"type": "image", "image": path|bytes|PIL};
    {"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}} (remote URLs are not
    fetched by the client).
    """
    if messages is not None:
        if prompt is not None or images:
            raise InvalidInputError("pass either messages, or a prompt with images, not both")
        return _convert_messages(messages)
    if prompt is None:
        raise InvalidInputError("a prompt or messages are required")
    if not isinstance(prompt, str):
        raise InvalidInputError("prompt must be a string")
    if images is None:
        images = ()
    elif isinstance(images, (str, bytes, bytearray, memoryview, os.PathLike)) or is_pil_image(images):
        images = [images]  # one image given bare
    elif isinstance(images, (dict, set)) or not isinstance(images, Iterable):
        raise InvalidInputError(f"images must be a list of images, not {type(images).__name__}")
    blobs = [load_image_bytes(im) for im in images]
    parts = [P.Part("image") for _ in blobs] + [P.Part("text", prompt)]
    return [P.ChatMessage("user", parts)], blobs


def input_loads_slowly(images: Any, messages: Any) -> bool:
    """Whether any image of (images, messages) may take a while to turn into bytes (see
    `epdq.media.loads_slowly`). Malformed arguments are not: `build_messages` refuses them at once."""
    if messages is not None:
        if not isinstance(messages, list):
            return False
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            for part in content if isinstance(content, (list, tuple)) else ():
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image" and loads_slowly(part.get("image")):
                    return True
                if kind == "image_url":
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    if isinstance(url, str) and len(url) > LOAD_INLINE_BYTES:
                        return True
        return False
    if images is None or isinstance(images, (dict, set)):
        return False
    if isinstance(images, (str, bytes, bytearray, memoryview, os.PathLike)) or is_pil_image(images):
        return loads_slowly(images)
    if isinstance(images, (list, tuple)):
        return any(loads_slowly(im) for im in images)
    return isinstance(images, Iterable)  # a generator: it is consumed once, by build_messages


def is_number(v: Any) -> bool:
    """A finite int or float that converts to a float (an int past ~1.8e308 does not: math.isfinite
    raised OverflowError on it, an untyped error for what is only a bad argument)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    if isinstance(v, int):
        return v.bit_length() <= 1023  # from about 2**1024 on, float(v) overflows
    return math.isfinite(v)


_SHOWN = 40


def shown(v: Any) -> str:
    """`v` for an error message, at most about 40 characters. repr() of an int of over 4,300
    digits raises ValueError (Python's int-to-str limit), and of a huge one takes long."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        return f"an integer of {v.bit_length()} bits"
    try:
        text = repr(v)
    except Exception:  # a caller's object whose __repr__ fails
        return f"a {type(v).__name__[:_SHOWN]}"
    return text[:_SHOWN]


def make_sampling(max_tokens: Any, temperature: Any, top_p: Any, seed: Any, stop: Any, ignore_eos: Any) -> P.Sampling:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise InvalidInputError(f"max_tokens must be an integer, not {shown(max_tokens)}")
    if not 1 <= max_tokens <= P.MAX_TOKENS_LIMIT:  # (beyond 2**64 it could not even be encoded)
        raise InvalidInputError(f"max_tokens must be in [1, {P.MAX_TOKENS_LIMIT}], not {shown(max_tokens)}")
    for name, v in (("temperature", temperature), ("top_p", top_p)):
        if not is_number(v):
            raise InvalidInputError(f"{name} must be a finite number, not {shown(v)}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not P.SEED_MIN <= seed <= P.SEED_MAX):
        raise InvalidInputError(f"seed must be a 64-bit signed integer or None, not {shown(seed)}")
    if isinstance(stop, str):
        stop = [stop]
    elif stop is None:
        stop = []
    elif isinstance(stop, (bytes, bytearray, Mapping)) or not isinstance(stop, Iterable):
        raise InvalidInputError(f"stop must be a string or a list of strings, not {type(stop).__name__}")
    else:
        stop = list(stop)
        if not all(isinstance(x, str) for x in stop):
            raise InvalidInputError("stop must be a string or a list of strings")
    if not isinstance(ignore_eos, bool):
        raise InvalidInputError("ignore_eos must be True or False")
    s = P.Sampling(max_tokens, float(temperature), float(top_p), seed, stop, ignore_eos)
    try:
        P.validate_sampling(s)  # the broker's ranges, checked before anything is sent
    except ProtocolError as e:
        raise InvalidInputError(e.message) from None
    return s


def _convert_messages(messages: list[dict]) -> tuple[list[P.ChatMessage], list[bytes]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidInputError("messages must be a non-empty list")
    out: list[P.ChatMessage] = []
    blobs: list[bytes] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidInputError("each message needs a role (a string) and content")
        content = m.get("content")
        if content is None:
            content = ""  # as OpenAI allows for an assistant turn
        if isinstance(content, str):
            out.append(P.ChatMessage(m["role"], [P.Part("text", content)]))
            continue
        if not isinstance(content, (list, tuple)):
            raise InvalidInputError("message content must be a string or a list of content parts")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text = part.get("text", "")
                if not isinstance(text, str):
                    raise InvalidInputError("a text part's text must be a string")
                parts.append(P.Part("text", text))
            elif kind == "image":
                blobs.append(load_image_bytes(part.get("image")))
                parts.append(P.Part("image"))
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                blobs.append(_data_url_bytes(url))
                parts.append(P.Part("image"))
            else:
                raise InvalidInputError(f"unsupported content part type {shown(kind)}")
        out.append(P.ChatMessage(m["role"], parts))
    return out, blobs


def _data_url_bytes(url: Any) -> bytes:
    if not isinstance(url, str) or not url.startswith("data:"):
        raise InvalidInputError("image_url must be a data: URL (the client does not fetch remote images)")
    return decode_data_url(url)
