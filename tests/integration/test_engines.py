"""E -> PD through real engines equals the colocated engine, token for token (tiny model, float32).

One process holds the transformers vision tower and two vLLM engines (each with its own EngineCore
process): "pd" fed precomputed embeddings and "both" fed pixels. Both engines start once per module.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio
import torch
from PIL import Image

from epdq.engines.base import EncodedImage, SamplingSpec
from epdq.errors import InvalidInputError
from tests.integration.helpers import abort_mid_stream, chat, collect

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SIZES = [(112, 112), (64, 200), (300, 150), (224, 224)]  # (height, width): four different grids


def noise_image(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def stack(encoded: list[EncodedImage]) -> tuple[torch.Tensor, torch.Tensor]:
    embeds = torch.cat([e.embeds for e in encoded])
    grid = torch.tensor([e.grid_thw for e in encoded], dtype=torch.int64)
    return embeds, grid





@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engines(model_dir):
    from epdq.engines.vllm_engine import VllmEngine

    pd = VllmEngine(model_dir, mode="pd", max_model_len=1024, max_num_seqs=4)
    both = VllmEngine(model_dir, mode="both", max_model_len=1024, max_num_seqs=4)
    try:
        await asyncio.wait_for(asyncio.gather(pd.start(), both.start()), 180)
        yield pd, both
    finally:
        await asyncio.gather(pd.close(), both.close())


SPEC = SamplingSpec(max_tokens=24)


@pytest.mark.parametrize("n_images", [0, 1, 2, 4])
async def test_pd_with_encoder_embeddings_equals_colocated(engines, encoder, n_images):
    pd, both = engines
    images = [noise_image(100 + i, SIZES[i]) for i in range(n_images)]
    prompt = pd.render_prompt(chat(n_images))
    assert prompt == both.render_prompt(chat(n_images))

    colocated = await collect(both, prompt, SPEC, images=images or None)
    if images:
        embeds, grid = stack(encoder.encode(images))
        assert embeds.shape[0] == pd.expected_embed_rows(grid)
        disaggregated = await collect(pd, prompt, SPEC, image_embeds=embeds, image_grid_thw=grid)
    else:
        disaggregated = await collect(pd, prompt, SPEC)

    assert len(colocated[0]) >= 8, "too few tokens for the comparison to mean anything"
    assert disaggregated == colocated


async def test_repeated_image_equals_colocated(engines, encoder):
    pd, both = engines
    image = noise_image(7, (112, 112))
    prompt = pd.render_prompt(chat(2))
    embeds, grid = stack(encoder.encode([image, image]))
    colocated = await collect(both, prompt, SPEC, images=[image, image])
    assert await collect(pd, prompt, SPEC, image_embeds=embeds, image_grid_thw=grid) == colocated


async def test_other_image_embeddings_change_output(engines, encoder):
    """Negative control: the equality above would be vacuous if the model ignored the image."""
    pd, _ = engines
    prompt = pd.render_prompt(chat(1))
    a, b = encoder.encode([noise_image(1, (112, 112)), noise_image(2, (112, 112))])
    assert a.grid_thw == b.grid_thw
    out_a = await collect(pd, prompt, SPEC, image_embeds=a.embeds, image_grid_thw=stack([a])[1])
    out_b = await collect(pd, prompt, SPEC, image_embeds=b.embeds, image_grid_thw=stack([b])[1])
    assert out_a[0] != out_b[0]
    # Order matters too: swapping two images' embeddings changes the answer.
    prompt2 = pd.render_prompt(chat(2))
    ab = await collect(
        pd, prompt2, SPEC, image_embeds=torch.cat([a.embeds, b.embeds]), image_grid_thw=stack([a, b])[1]
    )
    ba = await collect(
        pd, prompt2, SPEC, image_embeds=torch.cat([b.embeds, a.embeds]), image_grid_thw=stack([b, a])[1]
    )
    assert ab[0] != ba[0]


async def test_bad_embeddings_are_rejected_and_engine_survives(engines, encoder):
    pd, _ = engines
    prompt = pd.render_prompt(chat(1))
    (enc,) = encoder.encode([noise_image(3, (112, 112))])
    embeds, grid = stack([enc])
    wide = torch.zeros(embeds.shape[0], pd.hidden_size + 1)
    bad = {
        "one row short": dict(image_embeds=embeds[:-1], image_grid_thw=grid),
        "wrong width": dict(image_embeds=wide, image_grid_thw=grid),
        "2 grids, 1 placeholder": dict(
            image_embeds=torch.cat([embeds, embeds]), image_grid_thw=grid.repeat(2, 1)
        ),
        "float grid": dict(image_embeds=embeds, image_grid_thw=grid.float()),
        "grid not a multiple of merge": dict(image_embeds=embeds, image_grid_thw=torch.tensor([[1, 7, 9]])),
        "placeholder without embeddings": dict(),
        "pixels to a pd engine": dict(images=[noise_image(3, (112, 112))]),
    }
    for case, kwargs in bad.items():
        with pytest.raises(InvalidInputError):
            await collect(pd, prompt, SPEC, **kwargs)
            pytest.fail(f"accepted: {case}")
    with pytest.raises(InvalidInputError):  # longer than max_model_len: vLLM's own validation
        await collect(pd, pd.render_prompt(chat(0, "kite " * 2000)), SPEC)
    tokens, _, reason = await collect(pd, prompt, SPEC, image_embeds=embeds, image_grid_thw=grid)
    assert tokens and reason in ("stop", "length") and not pd.dead


async def test_an_image_the_processor_refuses_is_invalid_input_on_the_colocated_engine(engines):
    """vLLM wraps its processor's ValueError (aspect ratio > 200) in EngineGenerateError; it used
    to reach the client as EngineError ("retrying may help"; HTTP 500) where E->PD said 400."""
    _, both = engines
    prompt = both.render_prompt(chat(1))
    with pytest.raises(InvalidInputError, match="aspect ratio"):
        await collect(both, prompt, SPEC, images=[Image.new("RGB", (4000, 1))])
    tokens, _, reason = await collect(both, prompt, SPEC, images=[noise_image(5, (112, 112))])
    assert tokens and reason in ("stop", "length") and not both.dead


async def test_stream_chunks_and_abort(engines):
    pd, _ = engines
    prompt = pd.render_prompt(chat(0, "Tell a long story."))
    seen = await abort_mid_stream(pd, prompt, SamplingSpec(max_tokens=64, stop=()))
    assert 0 < len(seen) < 64
    # The engine keeps serving after an abort.
    assert (await collect(pd, prompt, SamplingSpec(max_tokens=4)))[2] == "length"


async def test_max_tokens_beyond_the_context_stops_at_the_context(engines):
    """What the gateway relies on for a request without max_tokens (it sends the protocol's limit,
    as vLLM's server defaults to the rest of the context): the engine stops at the context's end."""
    pd, _ = engines
    prompt = pd.render_prompt(chat(0, "kite " * 450))
    tokens, _, reason, n_prompt = await collect(
        pd, prompt, SamplingSpec(max_tokens=32768, ignore_eos=True, stop=()), usage=True
    )
    assert reason == "length" and n_prompt + len(tokens) == 1024, (n_prompt, len(tokens))


def test_render_prompt_one_placeholder_per_image(engines):
    pd, _ = engines
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "A"}, {"type": "image"}, {"type": "image_url"}],
        },
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "plain string content"},
    ]
    prompt = pd.render_prompt(messages)
    assert prompt.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "You are a helpful assistant" not in prompt  # the given system message replaces the default
    for bad in ([], [{"role": "user", "content": [{"type": "audio"}]}], [{"role": "robot", "content": "x"}]):
        with pytest.raises(InvalidInputError):
            pd.render_prompt(bad)
    with pytest.raises(InvalidInputError):
        pd.render_prompt(chat(9))  # over max_images_per_prompt=8


def test_encoder_scope_and_batching(model_dir, encoder):
    from epdq.engines.vision import HFVisionEncoder

    images = [noise_image(10 + i, size) for i, size in enumerate(SIZES)]
    batched = encoder.encode(images)
    for image, out in zip(images, batched, strict=True):
        (single,) = encoder.encode([image])
        assert out.grid_thw == single.grid_thw and out.embeds.is_contiguous()
        torch.testing.assert_close(out.embeds, single.embeds, rtol=1e-4, atol=1e-4)
    assert HFVisionEncoder(model_dir).scope == encoder.scope
    assert HFVisionEncoder(model_dir, dtype="bfloat16").scope != encoder.scope
    with pytest.raises(InvalidInputError):
        encoder.encode([])
    with pytest.raises(InvalidInputError):
        encoder.encode([noise_image(0, (1, 400))])  # aspect ratio over 200


async def test_dead_engine_core_raises_engine_error(model_dir):
    """A killed EngineCore must surface as EngineError (never a hang), and close() still works."""
    import multiprocessing
    import os
    import signal

    from epdq.engines.vllm_engine import VllmEngine
    from epdq.errors import EngineError

    engine = VllmEngine(model_dir, mode="pd", max_model_len=512, max_num_seqs=2)
    before = {p.pid for p in multiprocessing.active_children()}
    try:
        await asyncio.wait_for(engine.start(), 120)
        prompt = engine.render_prompt(chat(0))
        assert (await collect(engine, prompt, SamplingSpec(max_tokens=2)))[2] == "length"
        spawned = [p for p in multiprocessing.active_children() if p.pid not in before]
        assert spawned, "the engine core runs in a child process"
        for proc in spawned:
            os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(EngineError):
            for _ in range(50):  # the death is noticed asynchronously; each attempt must fail or pass
                await collect(engine, prompt, SamplingSpec(max_tokens=2))
                await asyncio.sleep(0.1)
        assert engine.dead
        with pytest.raises(EngineError):
            await collect(engine, prompt, SamplingSpec(max_tokens=2))
    finally:
        await asyncio.wait_for(engine.close(), 60)
