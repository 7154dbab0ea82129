"""Random-weight checkpoints with the real shapes of Qwen2.5-VL (epdq.models.real_shape).

The full presets are checked against the published dimensions without writing any weights; a
reduced variant (real widths, fewer layers, small vocabulary) is written on the CPU and loaded by
both engines, whose greedy outputs must agree (what the GPU check does at full size).
"""

from __future__ import annotations

import asyncio
import io
import json
import pathlib
import shutil
import tempfile

import pytest
import torch

from epdq.models import real_shape as R
from epdq.models.tiny import SPECIAL_TOKENS

pytestmark = pytest.mark.timeout(240)


def test_3b_preset_has_the_published_dimensions():
    spec = R.preset("qwen2.5-vl-3b")
    cfg = R.model_config(spec)
    text, vision = cfg["text_config"], cfg["vision_config"]
    assert cfg["architectures"] == ["Qwen2_5_VLForConditionalGeneration"] and cfg["model_type"] == "qwen2_5_vl"
    assert (text["hidden_size"], text["num_hidden_layers"], text["intermediate_size"]) == (2048, 36, 11008)
    assert (text["num_attention_heads"], text["num_key_value_heads"], text["vocab_size"]) == (16, 2, 151936)
    assert text["rope_parameters"]["mrope_section"] == [16, 24, 24] and text["rope_parameters"]["rope_theta"] == 1e6
    assert cfg["tie_word_embeddings"] is True
    assert (vision["depth"], vision["hidden_size"], vision["intermediate_size"], vision["num_heads"]) == (32, 1280, 3420, 16)
    assert (vision["out_hidden_size"], vision["patch_size"], vision["spatial_merge_size"]) == (2048, 14, 2)
    assert (vision["window_size"], vision["fullatt_block_indexes"], vision["temporal_patch_size"]) == (112, [7, 15, 23, 31], 2)
    # Qwen's special-token ids
    assert (cfg["image_token_id"], cfg["video_token_id"]) == (151655, 151656)
    assert (cfg["vision_start_token_id"], cfg["vision_end_token_id"]) == (151652, 151653)
    assert text["eos_token_id"] == 151645 and text["bos_token_id"] == 151643


def test_presets_instantiate_in_transformers_with_the_published_parameter_counts():
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(**R.model_config(R.preset("qwen2.5-vl-3b")))
    assert config.text_config.hidden_size == 2048 and config.vision_config.out_hidden_size == 2048
    # 3.75 B and 8.29 B: the sizes of Qwen2.5-VL-3B-Instruct and -7B-Instruct
    assert round(R.parameter_count(R.preset("qwen2.5-vl-3b")) / 1e9, 2) == 3.75
    assert round(R.parameter_count(R.preset("qwen2.5-vl-7b")) / 1e9, 2) == 8.29
    spec7 = R.preset("qwen2.5-vl-7b")
    assert (spec7.hidden_size, spec7.num_layers, spec7.num_heads, spec7.num_kv_heads) == (3584, 28, 28, 4)
    assert "lm_head.weight" not in R.parameter_shapes(R.preset("qwen2.5-vl-3b"))  # tied
    assert "lm_head.weight" in R.parameter_shapes(spec7)


def test_preset_validation():
    with pytest.raises(ValueError, match="unknown preset"):
        R.preset("qwen9")
    with pytest.raises(ValueError, match="mrope_section"):
        R.preset("qwen2.5-vl-3b", num_heads=32)
    with pytest.raises(ValueError, match="special_base"):
        R.preset("qwen2.5-vl-3b", vocab_size=2100)


def test_write_checkpoint_refuses_a_filesystem_without_room(tmp_path, monkeypatch):
    spec = R.preset("qwen2.5-vl-3b")
    real = shutil.disk_usage
    monkeypatch.setattr(R.shutil, "disk_usage", lambda d: real(d)._replace(free=300 << 20))
    with pytest.raises(R.NotEnoughRoom, match=r"300 MiB free; the checkpoint needs 7,2\d\d MiB"):
        R.write_checkpoint(tmp_path / "m", spec)
    assert list(tmp_path.iterdir()) == []  # nothing half-written
    assert R.main([str(tmp_path / "m")]) == 2


def _roomy_dir(tmp_path_factory, need: int) -> pathlib.Path:
    """The test's scratch space, or tmpfs when that disk is short: the reduced checkpoint is ~1 GB,
    and a CI machine's disk has been seen with less than that free."""
    first = tmp_path_factory.mktemp("rs")
    if shutil.disk_usage(first).free >= need:
        return first
    shm = pathlib.Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free >= need:
        return pathlib.Path(tempfile.mkdtemp(prefix="epdq-test-rs-", dir=shm))
    pytest.skip(f"no room for a {need >> 20} MiB checkpoint: {first} and /dev/shm are both short")


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    spec = R.preset("qwen2.5-vl-3b", num_layers=2, vision_depth=1, vocab_size=2304, special_base=2200,
                    matrix_gain=3.0)  # fmt: skip
    base = _roomy_dir(tmp_path_factory, R.checkpoint_bytes(spec, "float32") + (256 << 20))
    try:
        yield spec, R.write_checkpoint(base / "m", spec, dtype="float32", shard_bytes=128 << 20)
    finally:
        shutil.rmtree(base, ignore_errors=True)  # a GB that the rest of the run may need


def test_reduced_checkpoint_files(reduced):
    spec, path = reduced
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2 and all((path / s).is_file() for s in shards)
    vision_shards = {f for n, f in index["weight_map"].items() if n.startswith("model.visual.")}
    other = {f for n, f in index["weight_map"].items() if not n.startswith("model.visual.")}
    assert vision_shards and not vision_shards & other  # an encoder reads only its own files
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["text_config"]["hidden_size"] == 2048 and cfg["vision_config"]["hidden_size"] == 1280
    assert cfg["text_config"]["num_hidden_layers"] == 2 and cfg["vision_config"]["depth"] == 1


def test_reduced_tokenizer_keeps_the_layout(reduced):
    from transformers import AutoTokenizer

    spec, path = reduced
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == spec.vocab_size
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(2200, 2200 + len(SPECIAL_TOKENS)))
    assert tok.decode(tok.encode("A red kite, 42 times.")) == "A red kite, 42 times."
    assert tok.decode([spec.vocab_size - 1])  # every id the model can emit decodes


def test_real_tokenizer_ids_at_full_size(tmp_path):
    from transformers import AutoTokenizer

    spec = R.preset("qwen2.5-vl-3b")
    R.write_tokenizer(tmp_path, spec)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 151936
    assert tok.convert_tokens_to_ids("<|image_pad|>") == 151655 and tok.convert_tokens_to_ids("<|im_end|>") == 151645


def test_reduced_checkpoint_runs_epd_equal_to_pixels(reduced):
    """The vision tower alone (encoder) + the PD engine fed its embeddings == the model fed pixels."""
    from PIL import Image

    from epdq.demo import demo_image
    from epdq.engines.base import SamplingSpec
    from epdq.engines.hf_pd import HFPDEngine
    from epdq.engines.vision import HFVisionEncoder

    _, path = reduced
    images = [Image.open(io.BytesIO(demo_image(s, (112 + 28 * s, 84)))).convert("RGB") for s in range(2)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Hi."}]}]

    async def run():
        enc = HFVisionEncoder(path)
        pd, both = HFPDEngine(path, mode="pd"), HFPDEngine(path, mode="both")
        # concurrently, on purpose: transformers' meta-device init is not thread-safe, and without
        # MODEL_LOAD_LOCK these loads fail every time (a tied lm_head left on "meta")
        await asyncio.gather(pd.start(), both.start())
        try:
            prompt = pd.render_prompt(messages)
            out = enc.encode(images)
            kw = {"image_embeds": torch.cat([o.embeds for o in out]),
                  "image_grid_thw": torch.tensor([o.grid_thw for o in out], dtype=torch.int64)}  # fmt: skip
            results = []
            for engine, extra in ((pd, kw), (both, {"images": images})):
                ids = []
                async for d in engine.generate("r", prompt, SamplingSpec(max_tokens=8), **extra):
                    ids += d.token_ids
                results.append(ids)
            return results
        finally:
            await asyncio.gather(pd.close(), both.close())

    epd, pixels = asyncio.run(run())
    assert epd == pixels and len(epd) == 8
    assert len(set(epd)) > 1  # not a degenerate constant output
