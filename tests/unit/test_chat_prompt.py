"""The prompt every PD engine renders: one image placeholder per image part, no more."""

from __future__ import annotations

import pytest

from epdq.engines.base import IMAGE_PLACEHOLDER, render_chat_prompt
from epdq.errors import InvalidInputError


class Template:
    """A stand-in for a tokenizer's chat template: text as given, a placeholder per image part."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        out = []
        for m in messages:
            content = m["content"]
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            out.append("".join(p["text"] if p["type"] == "text" else IMAGE_PLACEHOLDER for p in parts))
        return "\n".join(out)


def image_message(text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {}}]}]


def test_one_placeholder_per_image():
    assert render_chat_prompt(Template(), image_message("look"), 4) == "look" + IMAGE_PLACEHOLDER


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": f"what is {IMAGE_PLACEHOLDER}?"}],
        image_message(f"and {IMAGE_PLACEHOLDER}"),
    ],
)
def test_the_placeholder_in_user_text_is_refused_by_name(messages):
    # it would give the engine more placeholders than embeddings; the error says why
    with pytest.raises(InvalidInputError, match="may not contain <\\|image_pad\\|>"):
        render_chat_prompt(Template(), messages, 4)


def test_too_many_images():
    with pytest.raises(InvalidInputError, match="exceed max_images_per_prompt"):
        render_chat_prompt(Template(), image_message("a") * 3, 2)


def test_max_tokens_when_the_request_names_none():
    pytest.importorskip("fastapi")
    import json

    from epdq.chat_request import parse_request, sampling_kwargs
    from epdq.gateway import GatewayConfig
    from epdq.protocol import MAX_TOKENS_LIMIT

    def max_tokens(body: dict, **cfg) -> int:
        req = parse_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}).encode())
        return sampling_kwargs(req, GatewayConfig("ipc:///x", **cfg))["max_tokens"]

    assert max_tokens({}) == MAX_TOKENS_LIMIT  # as vLLM: the engine stops at the end of the context
    assert max_tokens({}, default_max_tokens=100) == 100
    assert max_tokens({"max_tokens": 7}, default_max_tokens=100) == 7
    assert max_tokens({"max_tokens": 7, "max_completion_tokens": 9}) == 9
    with pytest.raises(ValueError, match="default_max_tokens"):
        GatewayConfig("ipc:///x", default_max_tokens=MAX_TOKENS_LIMIT + 1)


def test_an_unknown_content_part_type_is_not_echoed_whole():
    # pydantic's message quotes the tag: a 20 MiB `type` made a 20 MiB 400
    pytest.importorskip("fastapi")
    import json

    from epdq.chat_request import HTTPError, parse_request

    tag = "A" * (1 << 20)
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": tag}]}]}
    with pytest.raises(HTTPError) as ei:
        parse_request(json.dumps(body).encode())
    message = ei.value.message
    assert ei.value.status == 400 and len(message) < 400, len(message)
    assert "messages.0.content.0" in message and "AAAA" in message  # still says where, and what
