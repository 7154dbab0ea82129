"""No-op engines: the real worker code paths with no model behind them.

They exist to measure and test epdq itself (broker, credits, ring, hand-off, failure handling)
without paying for vLLM start-up or compute. Outputs are deterministic functions of the input
(prompt text and image pixels), so E->PD and the colocated route still give identical tokens and
a different image still changes the output. Optional per-image / per-token delays model cost.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
import zlib
from collections.abc import AsyncIterator, Sequence

import numpy as np
import torch

from epdq.engines.base import Delta, EncodedImage, SamplingSpec, embed_rows, validate_messages
from epdq.errors import CancelledError, InvalidInputError

PATCH = 14
MERGE = 2
VOCAB = 2048


def _grid(width: int, height: int) -> tuple[int, int, int]:
    # like Qwen2-VL's processor: patches of 14 px, merged 2x2, bounded to 4..16 tokens per side
    h = min(32, max(2, round(height / PATCH / MERGE) * MERGE))
    w = min(32, max(2, round(width / PATCH / MERGE) * MERGE))
    return (1, h, w)


def _image_embedding(image, hidden: int) -> EncodedImage:
    t, h, w = _grid(*image.size)
    raw = image.tobytes()
    # A content fingerprint (crc32: any change confined to a few bytes changes it; this engine
    # only has to tell images apart, not resist an adversary) expanded into rows x hidden values
    # in [-4, 4). A torch RNG seeded per image cost ~20 us of a no-op encode; this ~4 us.
    seed = struct.pack("<IQQQ", zlib.crc32(raw), len(raw), *image.size) + image.mode.encode()
    rows = t * h * w // MERGE**2
    vals = np.frombuffer(hashlib.shake_128(seed).digest(rows * hidden), dtype=np.int8).astype(np.float32)
    vals *= 1 / 32
    return EncodedImage(torch.from_numpy(vals.reshape(rows, hidden)), (t, h, w))


class NoopVisionEngine:
    scope = "noop-vision-v1"
    dtype = torch.float32

    def __init__(self, hidden_size: int = 128, cost_s: float = 0.0):
        if hidden_size < 1 or cost_s < 0:
            raise ValueError("hidden_size must be >= 1 and cost_s >= 0")
        self.hidden_size = hidden_size
        self.cost_s = cost_s
        self.inline = cost_s == 0  # nothing to wait for: the encoder may call it on its loop

    def encode(self, images: list) -> list[EncodedImage]:
        if self.cost_s:
            import time

            time.sleep(self.cost_s * len(images))
        return [_image_embedding(im, self.hidden_size) for im in images]


class NoopPDEngine:
    """Emits `max_tokens` tokens derived from the prompt and the image embeddings' bytes."""

    def __init__(self, hidden_size: int = 128, token_s: float = 0.0, prefill_s: float = 0.0):
        if hidden_size < 1 or token_s < 0 or prefill_s < 0:
            raise ValueError("hidden_size must be >= 1 and delays >= 0")
        self.hidden_size = hidden_size
        self.token_s = token_s
        self.prefill_s = prefill_s
        self._active: set[str] = set()
        self._aborted: set[str] = set()

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def render_prompt(self, messages: list[dict]) -> str:
        validate_messages(messages)
        out = []
        for m in messages:
            content = m["content"]
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            text = "".join("<image>" if p["type"] != "text" else p["text"] for p in parts)
            out.append(f"{m['role']}: {text}")
        return "\n".join(out) + "\nassistant:"

    def expected_embed_rows(self, grid_thw: Sequence[Sequence[int]] | torch.Tensor) -> int:
        return embed_rows(grid_thw, MERGE)

    async def generate(
        self,
        request_id: str,
        prompt: str,
        sampling: SamplingSpec,
        *,
        image_embeds: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        images: list | None = None,
    ) -> AsyncIterator[Delta]:
        n_images = prompt.count("<image>")
        if images is not None:
            encoded = [_image_embedding(im, self.hidden_size) for im in images]
            image_embeds = torch.cat([e.embeds for e in encoded]) if encoded else None
            image_grid_thw = torch.tensor([e.grid_thw for e in encoded]) if encoded else None
        if n_images and (image_grid_thw is None or len(image_grid_thw) != n_images):
            raise InvalidInputError(f"prompt has {n_images} images but embeddings for a different number")
        h = hashlib.blake2b(prompt.encode(), digest_size=16)
        if image_embeds is not None:
            if self.expected_embed_rows(image_grid_thw) != image_embeds.shape[0]:
                raise InvalidInputError("embedding rows do not match the grids")
            h.update(memoryview(image_embeds.contiguous().numpy()).cast("B"))
        state = int.from_bytes(h.digest(), "little")
        # no tokenizer here: count the prompt's bytes, each image marker as its embedding rows
        n_prompt = len(prompt.encode()) - n_images * len("<image>")
        if image_embeds is not None:
            n_prompt += image_embeds.shape[0]
        self._active.add(request_id)
        try:
            if self.prefill_s:
                await asyncio.sleep(self.prefill_s)
            async for d in self._tokens(request_id, state, sampling.max_tokens, n_prompt):
                yield d
        finally:
            self._active.discard(request_id)
            self._aborted.discard(request_id)

    async def _tokens(self, request_id: str, state: int, n: int, n_prompt: int) -> AsyncIterator[Delta]:
        for i in range(n):
            if request_id in self._aborted:
                raise CancelledError("aborted", request_id=request_id)
            state = (state * 6364136223846793005 + 1442695040888963407) % 2**128
            token = (state >> 64) % VOCAB
            last = i == n - 1
            if self.token_s:
                await asyncio.sleep(self.token_s)
            elif i % 16 == 15:
                await asyncio.sleep(0)  # stay cancellable without a delay
            yield Delta([token], f"<{token}>", "length" if last else None, n_prompt if last else 0)

    async def abort(self, request_id: str) -> None:
        if request_id in self._active:
            self._aborted.add(request_id)
