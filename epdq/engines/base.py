"""The small engine interface that workers depend on.

Workers know these types, not the backends: a model family or an inference backend is one module
that implements `VisionEngine` (images -> embeddings) or `PDEngine` (prefill + decode, fed
precomputed embeddings or, for the colocated baseline, images).
"""

from __future__ import annotations

import math
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import PIL.Image
    import torch

# Generous for a serving system, small enough that a typo cannot reserve a huge KV budget.
MAX_TOKENS_CAP = 32768
# Building a transformers model is not safe in two threads of one process at once: its meta-device
# initialisation can leave the other model's weights on "meta" (seen as a tied lm_head never
# materialised). Engines in one process (tests, benchmarks) load one at a time.
MODEL_LOAD_LOCK = threading.Lock()
FINISH_REASONS = ("stop", "length")
_IMAGE_PART_TYPES = ("image", "image_url")
_TEXT_PART_TYPES = ("text",)
_ROLES = ("system", "user", "assistant")
# vLLM samples greedily below its _SAMPLING_EPS, but first raises any temperature in (0, 0.01)
# to 0.01 (its _MAX_TEMP, against NaN/inf in its sampler), so there 1e-6 sampled at 0.01 while
# the hf engine took it as greedy. Every engine maps the request's value through
# `engine_temperature`: the same sampling whichever backend serves the request.
GREEDY_BELOW = 1e-5
MIN_TEMPERATURE = 0.01
# vLLM's SamplingParams turns seed -1 into "no seed" (random), the hf engine seeded with it: no
# engine can honour both readings, so -1 is refused wherever a request is checked.
UNSEEDED_SEED = -1
SEED_MINUS_ONE = "seed -1 is not accepted (vLLM reads it as 'no seed'): leave seed unset for random sampling"


@dataclass(slots=True)
class EncodedImage:
    """One image's embeddings: `embeds` is [n_tokens, hidden], contiguous, on CPU."""

    embeds: torch.Tensor
    grid_thw: tuple[int, int, int]

    def __post_init__(self) -> None:
        if len(self.grid_thw) != 3 or any(int(v) <= 0 for v in self.grid_thw):
            raise ValueError(f"grid_thw must be three positive ints, got {self.grid_thw}")
        self.grid_thw = (int(self.grid_thw[0]), int(self.grid_thw[1]), int(self.grid_thw[2]))
        if self.embeds.dim() != 2:
            raise ValueError(f"embeds must be 2-D [n_tokens, hidden], got shape {tuple(self.embeds.shape)}")


@dataclass(slots=True)
class SamplingSpec:
    """Sampling parameters a PD engine accepts (a backend maps them onto its own type)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks, fixed-length tests)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError("max_tokens must be an int")
        if not 1 <= self.max_tokens <= MAX_TOKENS_CAP:
            raise ValueError(f"max_tokens must be in [1, {MAX_TOKENS_CAP}], got {self.max_tokens}")
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)):
            raise ValueError("temperature must be a finite number")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not (isinstance(self.top_p, int | float) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError("seed must be an int or None")
        if self.seed == UNSEEDED_SEED:
            raise ValueError(SEED_MINUS_ONE)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError("ignore_eos must be a bool")
        if isinstance(self.stop, str):
            raise ValueError("stop must be a sequence of strings, not a string")
        self.stop = tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop entries must be non-empty strings")


def engine_temperature(temperature: float) -> float:
    """The temperature every engine samples with: 0.0 (greedy) below GREEDY_BELOW, at least
    MIN_TEMPERATURE otherwise (what vLLM itself does to values in [GREEDY_BELOW, 0.01))."""
    if temperature < GREEDY_BELOW:
        return 0.0
    return max(temperature, MIN_TEMPERATURE)


@dataclass(slots=True)
class Delta:
    """A streamed chunk: may carry several tokens; `finish_reason` is set on the last one, and so
    is `prompt_tokens`: the prompt's length as the engine ran it (image placeholders expanded)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS} or None")


@runtime_checkable
class VisionEngine(Protocol):
    # Fingerprint of weights + processor settings: embeddings are reusable across encoders with
    # the same scope (the broker's content-hash dedup is keyed by it).
    scope: str
    hidden_size: int
    dtype: torch.dtype

    def encode(self, images: list[PIL.Image.Image]) -> list[EncodedImage]:
        """Encode all images in ONE batched forward; one result per image, in order."""
        ...


@runtime_checkable
class PDEngine(Protocol):
    """Optional, outside the protocol (looked up with getattr): `async def forget_cached_inputs()`,
    for an engine that caches what it computed from its inputs under a hash of them (vLLM's prefix
    and multimodal caches). A PD worker calls it when embeddings it handed over in place (a view
    of a ring entry) were overwritten while the engine read them: the hash may name other bytes
    than the engine computed with. Engines without it cache nothing across requests."""

    hidden_size: int

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def render_prompt(self, messages: list[dict]) -> str:
        """Chat messages -> prompt text with one un-expanded image placeholder per image part."""
        ...

    def generate(
        self,
        request_id: str,
        prompt: str,
        sampling: SamplingSpec,
        *,
        image_embeds: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        images: list[PIL.Image.Image] | None = None,
    ) -> AsyncIterator[Delta]: ...

    async def abort(self, request_id: str) -> None: ...

    def expected_embed_rows(self, grid_thw: Sequence[Sequence[int]] | torch.Tensor) -> int:
        """Rows of `image_embeds` the engine expects for these grids (sum(t*h*w) / merge^2)."""
        ...


def validate_messages(messages: object) -> None:
    """Check OpenAI-style chat messages (content: a string or a list of text/image parts)."""
    from epdq.errors import InvalidInputError

    if not isinstance(messages, list) or not messages:
        raise InvalidInputError("messages must be a non-empty list")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
            raise InvalidInputError(f"message {i} needs a role in {_ROLES}")
        content = msg.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise InvalidInputError(f"message {i} content must be a string or a list of parts")
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _TEXT_PART_TYPES:
                if not isinstance(part.get("text"), str):
                    raise InvalidInputError(f"message {i} part {j}: text part needs a string 'text'")
            elif kind not in _IMAGE_PART_TYPES:
                raise InvalidInputError(f"message {i} part {j}: unsupported part type {kind!r}")


def count_image_parts(messages: list[dict]) -> int:
    return sum(
        1
        for msg in messages
        if isinstance(msg.get("content"), list)
        for part in msg["content"]
        if part.get("type") in _IMAGE_PART_TYPES
    )


IMAGE_PLACEHOLDER = "<|image_pad|>"


def render_chat_prompt(tokenizer, messages: list[dict], max_images: int) -> str:
    """The checkpoint's chat template applied to OpenAI-style messages, with exactly one
    un-expanded image placeholder per image part (shared by every PD engine: the same prompt
    on every route is what makes their outputs comparable)."""
    from epdq.errors import InvalidInputError

    validate_messages(messages)
    n_images = count_image_parts(messages)
    if n_images > max_images:
        raise InvalidInputError(f"{n_images} images exceed max_images_per_prompt={max_images}")
    try:
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja errors: the template rejected these messages
        raise InvalidInputError(f"chat template failed: {exc}") from exc
    if prompt.count(IMAGE_PLACEHOLDER) != n_images:
        if any(IMAGE_PLACEHOLDER in text for text in _texts(messages)):
            raise InvalidInputError(f"message text may not contain {IMAGE_PLACEHOLDER}: the model reserves it for images")
        raise InvalidInputError("the chat template did not produce one image placeholder per image part")
    return prompt


def _texts(messages: list[dict]):
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            yield from (p["text"] for p in content if p.get("type") in _TEXT_PART_TYPES)


def embed_rows(grid_thw, merge_size: int) -> int:
    """Rows of image embeddings for these [t, h, w] grids: sum(t*h*w) / merge^2."""
    rows = grid_thw.tolist() if hasattr(grid_thw, "tolist") else grid_thw
    return sum(int(t) * int(h) * int(w) for t, h, w in rows) // merge_size**2
