"""Randomly initialised checkpoints with the REAL shapes of published models (Qwen2.5-VL 3B / 7B).

Performance depends on shapes, not values: a checkpoint with Qwen2.5-VL-3B's dimensions and
random weights costs what the real one costs to load, encode, prefill and decode, and it can be
made on a machine that cannot download anything. Everything else follows the tiny checkpoint
(`epdq.models.tiny`): the real Hugging Face format (config.json, sharded safetensors with an
index, tokenizer, image processor, chat template), so the serving code loads it through the same
paths as a downloaded one. Output text is meaningless; correctness checks compare routes.

The tokenizer keeps Qwen's ids where they matter: ordinary tokens below 151643, then Qwen's
special tokens in Qwen's order (<|endoftext|> = 151643 ... <|video_pad|> = 151656), then reserved
fillers up to the embedding size, so every id the model can emit decodes. Its ordinary tokens are
a small BPE learned on the tiny corpus, padded with filler entries no input text produces.

Weights: embeddings N(0, 1); every matrix N(0, gain^2 / fan_in) with gain 2, which keeps activations
growing slowly through the real depth (so greedy output varies with the prompt and image); norm
scales 1, biases 0. Values are drawn on the chosen device (`device="cuda"`: a 3B checkpoint is
generated in seconds) in `dtype`, deterministic for a seed on a given device.

    python -m epdq.models.real_shape OUT_DIR --preset qwen2.5-vl-3b --device cuda
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

from epdq.models.tiny import (
    SPECIAL_TOKENS,
    TinySpec,
    _image_processor_config,
    _replace_dir,
    _write_json,
    check_replaceable,
    tokenizer_config,
    train_bpe,
    write_processor_files,
)

QWEN_SPECIAL_BASE = 151643  # id of <|endoftext|> in Qwen2 / Qwen2.5 tokenizers
_BPE_TOKENS = TinySpec().vocab_size - len(SPECIAL_TOKENS)  # what the tiny corpus yields exactly
_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True, slots=True)
class ShapeSpec:
    """Every dimension of a Qwen2.5-VL checkpoint (field names follow `epdq.models.tiny.TinySpec`)."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    vision_depth: int
    vision_hidden_size: int
    vision_intermediate_size: int
    vision_heads: int
    mrope_section: tuple[int, int, int] = (16, 24, 24)
    max_position_embeddings: int = 128000
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    tokens_per_second: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 16384  # 12845056, Qwen2.5-VL's processor default
    special_base: int = QWEN_SPECIAL_BASE
    embed_std: float = 1.0
    matrix_gain: float = 2.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
        head_dim = self.hidden_size // self.num_heads
        if sum(self.mrope_section) * 2 != head_dim:
            raise ValueError(f"mrope_section must sum to head_dim/2 = {head_dim // 2}")
        if self.vision_hidden_size % self.vision_heads:
            raise ValueError("vision_hidden_size must divide by vision_heads")
        if not _BPE_TOKENS <= self.special_base <= self.vocab_size - len(SPECIAL_TOKENS):
            raise ValueError(
                f"special_base must be in [{_BPE_TOKENS}, vocab_size - {len(SPECIAL_TOKENS)}], got {self.special_base}"
            )
        if min(self.num_layers, self.vision_depth) < 1:
            raise ValueError("need at least one decoder layer and one vision block")

    def token_id(self, token: str) -> int:
        return self.special_base + SPECIAL_TOKENS.index(token)


# Dimensions as published in the models' config.json (Qwen/Qwen2.5-VL-3B-Instruct, -7B-Instruct).
PRESETS: dict[str, ShapeSpec] = {
    "qwen2.5-vl-3b": ShapeSpec(
        name="qwen2.5-vl-3b", vocab_size=151936, hidden_size=2048, num_layers=36, num_heads=16, num_kv_heads=2,
        intermediate_size=11008, tie_word_embeddings=True, vision_depth=32, vision_hidden_size=1280,
        vision_intermediate_size=3420, vision_heads=16,
    ),
    "qwen2.5-vl-7b": ShapeSpec(
        name="qwen2.5-vl-7b", vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
        intermediate_size=18944, tie_word_embeddings=False, vision_depth=32, vision_hidden_size=1280,
        vision_intermediate_size=3420, vision_heads=16,
    ),
}  # fmt: skip


def preset(name: str, **overrides) -> ShapeSpec:
    """A preset, optionally with some dimensions changed (e.g. fewer layers for a quick test)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    spec = PRESETS[name]
    if overrides:
        spec = dataclasses.replace(spec, name=f"{name}-custom", **overrides)
    return spec


def model_config(spec: ShapeSpec, dtype: str = "bfloat16") -> dict:
    """config.json (transformers 5 layout: text_config / vision_config, rope_parameters)."""
    tok = spec.token_id
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "dtype": dtype,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "image_token_id": tok("<|image_pad|>"),
        "video_token_id": tok("<|video_pad|>"),
        "vision_start_token_id": tok("<|vision_start|>"),
        "vision_end_token_id": tok("<|vision_end|>"),
        "text_config": {
            "model_type": "qwen2_5_vl_text",
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads,
            "hidden_act": "silu",
            "max_position_embeddings": spec.max_position_embeddings,
            "rms_norm_eps": spec.rms_norm_eps,
            "use_sliding_window": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": spec.rope_theta,
                "mrope_section": list(spec.mrope_section),
            },
            "bos_token_id": tok("<|endoftext|>"),
            "eos_token_id": tok("<|im_end|>"),
            "tie_word_embeddings": spec.tie_word_embeddings,
            "dtype": dtype,
        },
        "vision_config": {
            "model_type": "qwen2_5_vl_vision",
            "depth": spec.vision_depth,
            "hidden_size": spec.vision_hidden_size,
            "intermediate_size": spec.vision_intermediate_size,
            "num_heads": spec.vision_heads,
            "out_hidden_size": spec.hidden_size,
            "hidden_act": "silu",
            "in_channels": 3,
            "patch_size": spec.patch_size,
            "spatial_merge_size": spec.merge_size,
            "temporal_patch_size": spec.temporal_patch_size,
            "window_size": spec.window_size,
            "fullatt_block_indexes": list(spec.fullatt_block_indexes),
            "tokens_per_second": spec.tokens_per_second,
            "dtype": dtype,
        },
    }


def parameter_shapes(spec: ShapeSpec) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the checkpoint's tensors, from transformers' own class (on meta)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(**model_config(spec))
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if spec.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # tied to the token embedding, as in the published files
    return shapes


def parameter_count(spec: ShapeSpec) -> int:
    return sum(math.prod(s) for s in parameter_shapes(spec).values())


def checkpoint_bytes(spec: ShapeSpec | str, dtype: str = "bfloat16") -> int:
    """Bytes of weights `write_checkpoint` puts on disk (the tokenizer and configs are ~10 MB more)."""
    if isinstance(spec, str):
        spec = preset(spec)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    return parameter_count(spec) * (4 if dtype == "float32" else 2)


class NotEnoughRoom(OSError):
    """The target filesystem cannot hold the checkpoint; raised before a byte is written."""


_ROOM_MARGIN = 64 << 20  # tokenizer, configs, safetensors headers


def check_room(d: str | os.PathLike, need: int) -> None:
    # A half-written multi-GB checkpoint that dies on ENOSPC costs minutes and leaves a full
    # disk behind; say so before starting.
    free = shutil.disk_usage(d).free
    if free < need + _ROOM_MARGIN:
        raise NotEnoughRoom(
            f"{d} has {free / 2**20:,.0f} MiB free; the checkpoint needs {(need + _ROOM_MARGIN) / 2**20:,.0f} MiB"
        )


def write_checkpoint(
    out_dir: str | os.PathLike,
    spec: ShapeSpec | str = "qwen2.5-vl-3b",
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    device: str = "cpu",
    shard_bytes: int = 2 << 30,
    overwrite: bool = False,
    log=None,
) -> pathlib.Path:
    """Write a checkpoint with `spec`'s shapes and random weights to `out_dir` (atomically)."""
    if isinstance(spec, str):
        spec = preset(spec)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    out = pathlib.Path(out_dir).absolute()
    check_replaceable(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_room(out.parent, checkpoint_bytes(spec, dtype))
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_json(staging / "config.json", model_config(spec, dtype))
        _write_json(
            staging / "generation_config.json",
            {
                "bos_token_id": spec.token_id("<|endoftext|>"),
                "eos_token_id": [spec.token_id("<|im_end|>"), spec.token_id("<|endoftext|>")],
                "pad_token_id": spec.token_id("<|endoftext|>"),
            },
        )
        proc = _image_processor_config(spec)
        proc["processor_class"] = "Qwen2_5_VLProcessor"
        _write_json(staging / "preprocessor_config.json", proc)
        write_processor_files(staging, spec, "Qwen2_5_VLProcessor")
        write_tokenizer(staging, spec)
        _write_weights(staging, spec, seed=seed, dtype=dtype, device=device, shard_bytes=shard_bytes, log=log)
        (staging / ".complete").write_text(f"preset={spec.name} seed={seed} dtype={dtype}\n")
        for f in staging.iterdir():
            f.chmod(0o644)
        staging.chmod(0o755)
        _replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def write_tokenizer(d: pathlib.Path, spec: ShapeSpec) -> None:
    """tokenizer.json + tokenizer_config.json with Qwen's special-token ids (see the module doc)."""
    from tokenizers import AddedToken, Tokenizer

    tok = train_bpe(_BPE_TOKENS)
    # Pad the model's vocabulary with fillers up to Qwen's first special id. A filler mixes
    # characters that the pre-tokenizer always splits apart, so no merge can ever produce one.
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    for i in range(len(vocab), spec.special_base):
        vocab[f"<|fill_{i}|>"] = i
    tok = Tokenizer.from_str(json.dumps(data))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    reserved = spec.special_base + len(SPECIAL_TOKENS)
    tok.add_special_tokens(
        [AddedToken(f"<|reserved_{i}|>", special=True, normalized=False) for i in range(reserved, spec.vocab_size)]
    )
    for t in SPECIAL_TOKENS:
        if tok.token_to_id(t) != spec.token_id(t):
            raise RuntimeError(f"{t} got id {tok.token_to_id(t)}, expected {spec.token_id(t)}")
    if tok.get_vocab_size() != spec.vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, the model {spec.vocab_size}")
    tok.save(str(d / "tokenizer.json"))
    _write_json(
        d / "tokenizer_config.json", tokenizer_config(spec.max_position_embeddings, "Qwen2_5_VLProcessor")
    )


def _std(name: str, shape: tuple[int, ...], spec: ShapeSpec) -> float:
    if "embed_tokens" in name or name.startswith("lm_head"):
        return spec.embed_std
    return spec.matrix_gain / math.sqrt(math.prod(shape[1:]))


def _write_weights(
    d: pathlib.Path, spec: ShapeSpec, *, seed: int, dtype: str, device: str, shard_bytes: int, log
) -> None:
    import torch
    from safetensors.torch import save_file

    say = log or (lambda _m: None)
    tdtype = getattr(torch, dtype)
    shapes = parameter_shapes(spec)
    # the vision tower first, in shards of its own: an encoder reads only those files
    names = sorted(shapes, key=lambda n: (not n.startswith(("model.visual.", "visual.")), n))
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    shards: list[list[str]] = [[]]
    size = 0
    vision = True
    for n in names:
        nbytes = math.prod(shapes[n]) * tdtype.itemsize
        is_vision = n.startswith(("model.visual.", "visual."))
        if shards[-1] and (size + nbytes > shard_bytes or is_vision != vision):
            shards.append([])
            size = 0
        vision = is_vision
        shards[-1].append(n)
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    t0 = time.perf_counter()
    for i, group in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for n in group:
            shape = shapes[n]
            if len(shape) == 1:
                is_scale = n.endswith(".weight") and ("norm" in n or "ln_q" in n)
                t = (torch.ones if is_scale else torch.zeros)(shape, dtype=tdtype, device=device)
            else:
                t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
                t = t.mul_(_std(n, shape, spec)).to(tdtype)
            tensors[n] = t.cpu().contiguous()
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
        save_file(tensors, str(d / fname), metadata={"format": "pt"})
        del tensors
        say(f"wrote {fname} ({time.perf_counter() - t0:.1f} s)")
    _write_json(d / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m epdq.models.real_shape", description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--preset", default="qwen2.5-vl-3b", choices=sorted(PRESETS))
    ap.add_argument("--dtype", default="bfloat16", choices=_DTYPES)
    ap.add_argument("--device", default="cpu", help="where the random values are drawn (cuda is much faster)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=0, help="override the decoder layer count (0 = the preset's)")
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    spec = preset(args.preset, num_layers=args.layers) if args.layers else preset(args.preset)
    t0 = time.perf_counter()
    try:
        path = write_checkpoint(
            args.out, spec, seed=args.seed, dtype=args.dtype, device=args.device, overwrite=args.overwrite,
            log=lambda m: print(m, file=sys.stderr),
        )  # fmt: skip
    except (NotEnoughRoom, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{spec.name}: {parameter_count(spec) / 1e9:.2f} B parameters in {path} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
