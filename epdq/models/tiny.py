"""A tiny, randomly initialised Qwen2-VL checkpoint in the real Hugging Face format.

Nothing here can download weights, yet the serving code must load real checkpoints (config,
safetensors, tokenizer, processor) through transformers and vLLM. This module writes one that is
small enough to build in seconds and big enough to exercise every loading path. Its text is
meaningless; tests compare routes against each other, never against expected words.

The bytes are a pure function of the seed (numpy PCG64 draws, sorted JSON, one-threaded BPE
training on a corpus shipped with the code), so two builds on any machine hash the same.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from typing import Any  # a TinySpec or real_shape's ShapeSpec

TINY_MODEL_NAME = "tiny-qwen2-vl-v1"

# Qwen2-VL's added tokens, in Qwen's order: they take the last ids of the vocabulary.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2's pre-tokenizer split (the GPT-4 style pattern Qwen publishes in its tokenizer.json).
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_VIDEO_MODULE = "tiny_video_processor"


@dataclass(slots=True)
class TinySpec:
    """Shapes of the tiny model (see notes/vllm-cpu.md for why these values)."""

    vocab_size: int = 2048
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    mrope_section: tuple[int, int, int] = (4, 6, 6)
    max_position_embeddings: int = 4096
    vision_depth: int = 2
    vision_embed_dim: int = 64
    vision_heads: int = 2
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 224 * 224
    # Default std 0.02 makes a random model repeat one token and ignore the image; these give
    # varied, image-dependent output, which equality tests need to mean anything.
    embed_std: float = 1.0
    matrix_std: float = 0.15

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be divisible by num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be divisible by num_kv_heads")
        head_dim = self.hidden_size // self.num_heads
        if sum(self.mrope_section) * 2 != head_dim:
            raise ValueError(f"mrope_section must sum to head_dim/2 = {head_dim // 2}")
        if self.vision_embed_dim % self.vision_heads:
            raise ValueError("vision_embed_dim must be divisible by vision_heads")
        if self.vocab_size <= len(SPECIAL_TOKENS) + 256:
            raise ValueError("vocab_size too small for the byte alphabet and special tokens")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError("need 0 < min_pixels <= max_pixels")

    def token_id(self, token: str) -> int:
        return self.vocab_size - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index(token)


def epdq_home() -> pathlib.Path:
    return pathlib.Path(os.environ.get("EPDQ_HOME") or pathlib.Path.home() / ".cache" / "epdq")


def default_model_dir() -> pathlib.Path:
    """The embedded default model, written on first use (safe when many processes race)."""
    target = epdq_home() / "models" / TINY_MODEL_NAME
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # The lock only avoids duplicated work; correctness comes from the atomic rename.
    with open(target.parent / f".{TINY_MODEL_NAME}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not _is_complete(target):
                write_tiny_checkpoint(target, overwrite=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def write_tiny_checkpoint(
    out_dir: str | os.PathLike, *, seed: int = 0, overwrite: bool = False
) -> pathlib.Path:
    """Write the tiny checkpoint to `out_dir` atomically and return its path."""
    out = pathlib.Path(out_dir).absolute()
    check_replaceable(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    spec = TinySpec()
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_files(staging, spec, seed)
        (staging / ".complete").write_text(f"seed={seed}\n")
        staging.chmod(0o755)  # mkdtemp makes it private; the checkpoint itself is not secret
        _replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def check_replaceable(out: pathlib.Path, overwrite: bool) -> None:
    """A checkpoint is written over an existing path only when asked, and only over a checkpoint
    epdq wrote (its `.complete` marker) or an empty directory: `--overwrite` given the wrong
    directory (`.`, a home directory) must refuse, not delete it."""
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise FileExistsError(f"{out} exists (overwrite=True, or --overwrite, replaces a checkpoint epdq wrote)")
    if not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory: refusing to replace it")
    if not (_is_complete(out) or not any(out.iterdir())):
        raise FileExistsError(f"{out} is not a checkpoint epdq wrote (no .complete marker): refusing to replace it")


def _is_complete(path: pathlib.Path) -> bool:
    return (path / ".complete").is_file()


def _replace_dir(staging: pathlib.Path, out: pathlib.Path) -> None:
    # rename() cannot replace a non-empty directory, so an old one is first moved aside; a reader
    # racing with an overwrite may briefly see no directory, never a half-written one.
    if out.exists():
        graveyard = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
        with contextlib.suppress(FileNotFoundError):
            os.rename(out, graveyard / "d")
        shutil.rmtree(graveyard, ignore_errors=True)
    try:
        os.rename(staging, out)
    except OSError:
        # Another process finished first; theirs is as good as ours (same bytes for the same seed).
        if not _is_complete(out):
            raise
        shutil.rmtree(staging, ignore_errors=True)


def _write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _resource_text(name: str) -> str:
    return resources.files("epdq.models").joinpath(name).read_text(encoding="utf-8")


def write_processor_files(d: pathlib.Path, spec: TinySpec | Any, processor_class: str) -> None:
    """The video processor (embedded remote code, see the template) and the chat template."""
    _write_json(
        d / "video_preprocessor_config.json",
        {
            "auto_map": {"AutoVideoProcessor": f"{_VIDEO_MODULE}.TinyVideoProcessor"},
            "video_processor_type": "TinyVideoProcessor",
            "processor_class": processor_class,
            "patch_size": spec.patch_size,
            "temporal_patch_size": spec.temporal_patch_size,
            "merge_size": spec.merge_size,
        },
    )
    (d / f"{_VIDEO_MODULE}.py").write_text(_resource_text("tiny_video_processor.py.tmpl"))
    (d / "chat_template.jinja").write_text(_resource_text("qwen2_vl_chat_template.jinja"))


def _write_files(d: pathlib.Path, spec: TinySpec, seed: int) -> None:
    _write_json(d / "config.json", _model_config(spec))
    _write_json(
        d / "generation_config.json",
        {
            "bos_token_id": spec.token_id("<|endoftext|>"),
            "eos_token_id": spec.token_id("<|im_end|>"),
            "pad_token_id": spec.token_id("<|endoftext|>"),
        },
    )
    _write_json(d / "preprocessor_config.json", _image_processor_config(spec))
    write_processor_files(d, spec, "Qwen2VLProcessor")
    _write_tokenizer(d, spec)
    _write_weights(d / "model.safetensors", spec, seed)
    for f in d.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; a shared cache must be readable by all workers


def _model_config(spec: TinySpec) -> dict:
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "dtype": "float32",
        "tie_word_embeddings": False,
        "image_token_id": spec.token_id("<|image_pad|>"),
        "video_token_id": spec.token_id("<|video_pad|>"),
        "vision_start_token_id": spec.token_id("<|vision_start|>"),
        "vision_end_token_id": spec.token_id("<|vision_end|>"),
        "text_config": {
            "model_type": "qwen2_vl_text",
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads,
            "hidden_act": "silu",
            "max_position_embeddings": spec.max_position_embeddings,
            "rms_norm_eps": 1e-6,
            "use_sliding_window": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": list(spec.mrope_section),
            },
            "bos_token_id": spec.token_id("<|endoftext|>"),
            "eos_token_id": spec.token_id("<|im_end|>"),
            "tie_word_embeddings": False,
            "dtype": "float32",
        },
        "vision_config": {
            "model_type": "qwen2_vl_vision",
            "depth": spec.vision_depth,
            "embed_dim": spec.vision_embed_dim,
            "hidden_size": spec.hidden_size,
            "hidden_act": "quick_gelu",
            "mlp_ratio": 4,
            "num_heads": spec.vision_heads,
            "in_channels": 3,
            "patch_size": spec.patch_size,
            "spatial_merge_size": spec.merge_size,
            "temporal_patch_size": spec.temporal_patch_size,
            "dtype": "float32",
        },
    }


def _image_processor_config(spec: TinySpec) -> dict:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(_CLIP_MEAN),
        "image_std": list(_CLIP_STD),
        "resample": 3,
        "min_pixels": spec.min_pixels,
        "max_pixels": spec.max_pixels,
        "size": {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
        "patch_size": spec.patch_size,
        "temporal_patch_size": spec.temporal_patch_size,
        "merge_size": spec.merge_size,
    }


def train_bpe(n_tokens: int):
    """A byte-level BPE tokenizer (Qwen's pre-tokenizer) learned from the embedded corpus, with
    exactly `n_tokens` ids, every one of which decodes to text; no special tokens yet."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n_tokens,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator([_resource_text("tiny_corpus.txt")], trainer)
    if tok.get_vocab_size() != n_tokens:
        # Every id must decode to text, so the corpus has to yield exactly this many tokens.
        raise RuntimeError(f"BPE learned {tok.get_vocab_size()} tokens, expected {n_tokens}")
    return tok


def _write_tokenizer(d: pathlib.Path, spec: TinySpec) -> None:
    from tokenizers import AddedToken

    tok = train_bpe(spec.vocab_size - len(SPECIAL_TOKENS))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for t in SPECIAL_TOKENS:
        assert tok.token_to_id(t) == spec.token_id(t), t
    tok.save(str(d / "tokenizer.json"), pretty=True)
    _write_json(d / "tokenizer_config.json", tokenizer_config(spec.max_position_embeddings, "Qwen2VLProcessor"))


def tokenizer_config(max_length: int, processor_class: str) -> dict:
    """tokenizer_config.json of a Qwen2-style chat tokenizer."""
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": max_length,
        "processor_class": processor_class,
    }


def _write_weights(path: pathlib.Path, spec: TinySpec, seed: int) -> None:
    import numpy as np
    import torch
    from safetensors.torch import save_file

    rng = np.random.Generator(np.random.PCG64(seed))
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in sorted(_parameter_shapes(spec).items()):
        if len(shape) == 1:
            is_norm_scale = name.endswith(".weight") and ("norm" in name or "ln_q" in name)
            value = np.ones(shape, np.float32) if is_norm_scale else np.zeros(shape, np.float32)
        else:
            std = (
                spec.embed_std if ("embed_tokens" in name or name.startswith("lm_head")) else spec.matrix_std
            )
            value = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(value))
    save_file(tensors, str(path), metadata={"format": "pt"})


def _parameter_shapes(spec: TinySpec) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the state dict, read from transformers' own model class (on meta)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(**_model_config(spec))
    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}
