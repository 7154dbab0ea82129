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
