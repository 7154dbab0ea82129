"""NaN or infinite image embeddings never reach vLLM.

vLLM decodes non-finite embeddings into garbage tokens without an error (the hf engine refuses
them). They are refused where they are made: the vision encoder, before its result is published
to the ring (and served to every request with that image), and the vLLM engine when its own
dtype cast makes them (float32 beyond float16's range is inf). The usual hand-off, embeddings in
the engine's dtype, is a view passed on without a scan."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from epdq.errors import EngineError, InvalidInputError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_dir():
    from epdq.models.tiny import default_model_dir

    return default_model_dir()


def noise_image(seed: int, size=(112, 112)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def encoder(model_dir):
    from epdq.engines.vision import HFVisionEncoder

    return HFVisionEncoder(model_dir)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_encoder_refuses_a_non_finite_result_naming_the_image(encoder, monkeypatch, bad):
    tower = encoder.model
    images = [noise_image(1), noise_image(2, (56, 112)), noise_image(3)]
    rows = [16, 8, 16]  # of these sizes: 112x112 -> 16 rows, 56x112 -> 8

    def overflowing(pixels, grid_thw):
        out = tower(pixels, grid_thw=grid_thw)
        embeds = getattr(out, "pooler_output", out).clone()
        embeds[rows[0] + 5, 7] = bad  # in the second image's rows
        return embeds

    monkeypatch.setattr(encoder, "model", overflowing)
    with pytest.raises(EngineError, match="NaN or infinite embeddings for image 1 of 3"):
        encoder.encode(images)
    monkeypatch.setattr(encoder, "model", tower)
    # the encoder worker then encodes a failed batch's images one by one: the others go through
    assert [e.embeds.shape[0] for e in encoder.encode(images)] == rows


@pytest.fixture(scope="module")
def fp16_engine(model_dir):
    from epdq.engines.vllm_engine import VllmEngine

    return VllmEngine(model_dir, mode="pd", dtype="float16", max_model_len=256)


def _grid() -> torch.Tensor:
    return torch.tensor([[1, 4, 4]])  # 4 rows


@pytest.mark.parametrize("value", [1e6, -70000.0, float("nan"), float("inf")])
def test_a_cast_to_the_engines_dtype_that_is_not_finite_is_refused(fp16_engine, value):
    embeds = torch.randn(4, fp16_engine.hidden_size)
    embeds[2, 3] = value
    with pytest.raises(InvalidInputError, match="not finite in float16"):
        fp16_engine._check_embeds(embeds, _grid(), 1)


def test_a_cast_that_fits_goes_through(fp16_engine):
    embeds = torch.randn(4, fp16_engine.hidden_size) * 100
    out, grid = fp16_engine._check_embeds(embeds, _grid(), 1)
    assert out.dtype == torch.float16 and torch.isfinite(out).all() and grid.dtype == torch.int64


def test_embeddings_in_the_engines_dtype_are_handed_on_in_place(fp16_engine):
    # the one-memcpy hand-off of a ring entry: vLLM makes the only copy, nothing scans it here
    embeds = torch.randn(4, fp16_engine.hidden_size).half()
    out, _ = fp16_engine._check_embeds(embeds, _grid(), 1)
    assert out.data_ptr() == embeds.data_ptr()
