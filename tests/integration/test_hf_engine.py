"""The transformers PD engine (`HFPDEngine`) as an independent reference (tiny model, float32).

Greedy tokens of the HF engine fed precomputed embeddings equal (a) the HF engine fed pixels,
(b) transformers' own `generate` fed the same embeddings through `mm_encoder_outputs`, and
(c) vLLM's PD engine fed the same embeddings, for 0, 1 and 2 images of different sizes.
"""

from __future__ import annotations

import asyncio
import io

import pytest
import pytest_asyncio
import torch
from PIL import Image

from epdq.demo import demo_image
from epdq.engines.base import PDEngine, SamplingSpec
from epdq.errors import InvalidInputError
from tests.integration.helpers import abort_mid_stream, chat, collect

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SPEC = SamplingSpec(max_tokens=12)
SIZES = [(112, 112), (200, 64)]  # (width, height) for demo_image: two different grids


def image(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.open(io.BytesIO(demo_image(seed, size))).convert("RGB")





@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def hf(model_dir):
    from epdq.engines.hf_pd import HFPDEngine

    pd = HFPDEngine(model_dir, mode="pd", max_model_len=1024)
    both = HFPDEngine(model_dir, mode="both", max_model_len=1024)
    await asyncio.gather(pd.start(), both.start())
    try:
        yield pd, both
    finally:
        await asyncio.gather(pd.close(), both.close())


def embeds_for(encoder, images):
    if not images:
        return {}
    encoded = encoder.encode(images)
    return {
        "image_embeds": torch.cat([e.embeds for e in encoded]),
        "image_grid_thw": torch.tensor([e.grid_thw for e in encoded], dtype=torch.int64),
    }


def model_generate(engine, prompt: str, kwargs: dict, max_new_tokens: int) -> list[int]:
    """transformers' own `generate`, fed the embeddings through `mm_encoder_outputs`."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    model, tok = engine._model, engine._tokenizer
    grid = kwargs.get("image_grid_thw")
    if grid is not None:
        pieces = prompt.split("<|image_pad|>")
        counts = (grid.prod(-1) // engine.merge_size**2).tolist()
        prompt = pieces[0] + "".join("<|image_pad|>" * c + p for c, p in zip(counts, pieces[1:], strict=True))
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    extra = {}
    if grid is not None:
        split = torch.split(kwargs["image_embeds"], counts)
        extra = dict(
            image_grid_thw=grid,
            mm_token_type_ids=(ids == engine.image_token_id).int(),
            mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=split)},
        )
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        do_sample=False, eos_token_id=sorted(engine._eos_ids), pad_token_id=sorted(engine._eos_ids)[0], **extra,
    )  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


def test_decoder_attention_excludes_cudnn_on_cuda_only(hf):
    """cuDNN SDPA cost 1.6 ms of host time per layer per decode step on an H200 (README, runs 3-4)."""
    pd, _ = hf
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with pd._decoder_attention():  # on the CPU: PyTorch's own choice, untouched
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
    cuda_engine = object.__new__(type(pd))
    cuda_engine.device = "cuda:0"
    with cuda_engine._decoder_attention():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_protocol(hf):
    pd, both = hf
    assert isinstance(pd, PDEngine) and isinstance(both, PDEngine)
    assert pd.hidden_size == 128


@pytest.mark.parametrize("n_images", [0, 1, 2])
async def test_pd_equals_colocated_generate_and_vllm(hf, vllm_pd, encoder, n_images):
    pd, both = hf
    images = [image(10 + i, SIZES[i]) for i in range(n_images)]
    prompt = pd.render_prompt(chat(n_images))
    assert prompt == both.render_prompt(chat(n_images)) == vllm_pd.render_prompt(chat(n_images))
    kwargs = embeds_for(encoder, images)

    disaggregated = await collect(pd, prompt, SPEC, usage=True, **kwargs)
    colocated = await collect(both, prompt, SPEC, usage=True, images=images or None)
    assert len(disaggregated[0]) >= 8, "too few tokens for the comparison to mean anything"
    assert disaggregated == colocated  # (a), prompt lengths included
    reference = await asyncio.to_thread(model_generate, pd, prompt, kwargs, SPEC.max_tokens)
    assert disaggregated[0] == reference  # (b) transformers' own generate
    assert await collect(vllm_pd, prompt, SPEC, usage=True, **kwargs) == disaggregated  # (c)


async def test_other_image_changes_output(hf, encoder):
    pd, _ = hf
    prompt = pd.render_prompt(chat(1))
    a = await collect(pd, prompt, SPEC, **embeds_for(encoder, [image(1, (112, 112))]))
    b = await collect(pd, prompt, SPEC, **embeds_for(encoder, [image(2, (112, 112))]))
    assert a[0] != b[0]


async def test_bad_inputs_rejected(hf, encoder):
    pd, both = hf
    prompt = pd.render_prompt(chat(1))
    good = embeds_for(encoder, [image(3, (112, 112))])
    embeds, grid = good["image_embeds"], good["image_grid_thw"]
    bad = {
        "one row short": dict(image_embeds=embeds[:-1], image_grid_thw=grid),
        "wrong width": dict(image_embeds=torch.zeros(embeds.shape[0], 129), image_grid_thw=grid),
        "2 grids, 1 placeholder": dict(
            image_embeds=torch.cat([embeds, embeds]), image_grid_thw=grid.repeat(2, 1)
        ),
        "float grid": dict(image_embeds=embeds, image_grid_thw=grid.float()),
        "grid not a multiple of merge": dict(image_embeds=embeds, image_grid_thw=torch.tensor([[1, 7, 9]])),
        "placeholder without embeddings": dict(),
        "pixels to a pd engine": dict(images=[image(3, (112, 112))]),
    }
    for case, kwargs in bad.items():
        with pytest.raises(InvalidInputError):
            await collect(pd, prompt, SPEC, **kwargs)
            pytest.fail(f"accepted: {case}")
    with pytest.raises(InvalidInputError):
        await collect(both, prompt, SPEC, **good)
    with pytest.raises(InvalidInputError):
        await collect(pd, pd.render_prompt(chat(0, "kite " * 2000)), SPEC)
    assert (await collect(pd, prompt, SPEC, **good))[2] == "length"


async def test_stop_strings_eos_and_sampling(hf):
    pd, _ = hf
    prompt = pd.render_prompt(chat(0, "Tell a story."))
    tokens, text, reason = await collect(pd, prompt, SamplingSpec(max_tokens=12))
    stop = text[3:6]
    assert stop.strip(), text
    s_tokens, s_text, s_reason = await collect(pd, prompt, SamplingSpec(max_tokens=12, stop=(stop,)))
    assert s_reason == "stop" and s_text == text[: text.find(stop)] and s_tokens == tokens[: len(s_tokens)]
    assert len(s_tokens) < len(tokens)
    # ignore_eos: exactly max_tokens
    assert len((await collect(pd, prompt, SamplingSpec(max_tokens=20, ignore_eos=True)))[0]) == 20
    # seeded sampling is reproducible
    spec = SamplingSpec(max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    assert await collect(pd, prompt, spec) == await collect(pd, prompt, spec)


async def test_eos_stops(hf):
    """An eos id ends the request with 'stop' and is the last token id (as vLLM reports it)."""
    pd, _ = hf
    prompt = pd.render_prompt(chat(0, "Hi."))
    tokens, _, _ = await collect(pd, prompt, SamplingSpec(max_tokens=12))
    saved = pd._eos_ids
    pd._eos_ids = frozenset({tokens[2]})  # pretend the third greedy token is eos
    try:
        got, _, reason = await collect(pd, prompt, SamplingSpec(max_tokens=12))
        ignored = await collect(pd, prompt, SamplingSpec(max_tokens=12, ignore_eos=True))
    finally:
        pd._eos_ids = saved
    first = tokens.index(tokens[2])
    assert got == tokens[: first + 1] and reason == "stop"
    assert ignored[0] == tokens


async def test_abort_and_concurrency(hf):
    pd, _ = hf
    prompt = pd.render_prompt(chat(0, "Tell a long story."))
    seen = await abort_mid_stream(pd, prompt, SamplingSpec(max_tokens=200, ignore_eos=True))
    assert 0 < len(seen) < 200
    # Concurrent requests interleave and still give the sequential answers.
    prompts = [pd.render_prompt(chat(0, t)) for t in ("One.", "Two words.", "Three more words.")]
    alone = [await collect(pd, p, SPEC) for p in prompts]
    together = await asyncio.gather(*(collect(pd, p, SPEC) for p in prompts))
    assert list(together) == alone
