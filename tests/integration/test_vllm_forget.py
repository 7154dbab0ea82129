"""VllmEngine.forget_cached_inputs on a real vLLM engine (tiny model, float32).

A PD worker hands vLLM one local image as a view of its ring entry. Overwritten between vLLM's
hash of it and its copy, vLLM computes KV of the wrong bytes and keeps it (prefix cache, encoder
and multimodal caches) under the right image's identity; the broker's retry of the same image
reused it. Here the race is replaced by what it leaves behind, made on purpose: other embeddings
sent under the image's identity (a client-given multimodal uuid stands in for the content hash).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from epdq.engines.base import SamplingSpec
from tests.integration.helpers import chat, collect

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SPEC = SamplingSpec(max_tokens=16, ignore_eos=True)
# ~280 prompt tokens: two full KV blocks (128 tokens on the CPU), which vLLM's prefix cache keeps
TEXT = "Describe the picture. " * 40


def noise_image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (112, 112, 3), dtype=np.uint8))


async def under_identity(engine, prompt: str, embeds: torch.Tensor, grid: torch.Tensor, uuid: str, rid: str):
    """(greedy tokens, prompt tokens served from the prefix cache) of a request whose image vLLM
    knows by `uuid` instead of its bytes' hash."""
    request = {
        "prompt": prompt,
        "multi_modal_data": {"image": {"image_embeds": embeds, "image_grid_thw": grid}},
        "multi_modal_uuids": {"image": [uuid]},
    }
    tokens, cached = [], 0
    async for out in engine._llm.generate(request, engine._sampling_params(SPEC), rid):
        tokens += out.outputs[0].token_ids
        cached = max(cached, out.num_cached_tokens or 0)
    return tokens, cached


async def test_after_forgetting_the_right_bytes_get_their_own_tokens(vllm_pd, encoder):
    prompt = vllm_pd.render_prompt(chat(1, TEXT))
    a, b = encoder.encode([noise_image(1), noise_image(2)])
    grid = torch.tensor([a.grid_thw])
    right = (await collect(vllm_pd, prompt, SPEC, image_embeds=a.embeds, image_grid_thw=grid))[0]
    wrong = (await collect(vllm_pd, prompt, SPEC, image_embeds=b.embeds, image_grid_thw=grid))[0]
    assert right != wrong, "the image must change the output, or nothing below means anything"

    # the stale request: image b's bytes under image a's identity
    assert (await under_identity(vllm_pd, prompt, b.embeds, grid, "image-a", "stale"))[0] == wrong
    # the retry, image a's right bytes under its identity, is served from what the stale one left
    tokens, cached = await under_identity(vllm_pd, prompt, a.embeds, grid, "image-a", "retry-1")
    assert tokens == wrong and cached >= 128
    await vllm_pd.forget_cached_inputs()
    assert await under_identity(vllm_pd, prompt, a.embeds, grid, "image-a", "retry-2") == (right, 0)


async def test_requests_running_while_it_forgets_finish_with_their_own_tokens(vllm_pd, encoder):
    prompt = vllm_pd.render_prompt(chat(1, TEXT))
    (c,) = encoder.encode([noise_image(3)])
    grid = torch.tensor([c.grid_thw])
    long = SamplingSpec(max_tokens=48, ignore_eos=True)
    alone = (await collect(vllm_pd, prompt, long, image_embeds=c.embeds, image_grid_thw=grid))[0]

    tokens: list[int] = []
    forgot = False
    async for delta in vllm_pd.generate("running", prompt, long, image_embeds=c.embeds, image_grid_thw=grid):
        tokens += delta.token_ids
        if not forgot:  # mid-decode: vLLM preempts it and recomputes what it had
            await vllm_pd.forget_cached_inputs()
            forgot = True
    assert tokens == alone and not vllm_pd.dead
