"""Qwen2-VL / Qwen2.5-VL vision tower on transformers: images -> embeddings for the PD engine.

Only the vision tower is built and only its tensors are read from the checkpoint, so an encoder
worker holds a fraction of the model. All images of a call go through one forward (patches
concatenated, one grid row per image); the output is split back per image.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import pathlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from epdq.engines.base import EncodedImage
from epdq.errors import EngineError, InvalidInputError

if TYPE_CHECKING:
    import PIL.Image

# model_type of the full config -> (module, vision tower class).
_VISION_CLASSES = {
    "qwen2_vl": ("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VisionTransformerPretrainedModel"),
    "qwen2_5_vl": (
        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
        "Qwen2_5_VisionTransformerPretrainedModel",
    ),
}
# transformers >= 4.52 saves the tower under model.visual., original Qwen checkpoints under visual.
_PREFIXES = ("model.visual.", "visual.")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFVisionEncoder:
    """VisionEngine for Qwen2-VL family checkpoints (see `epdq.engines.base.VisionEngine`)."""

    def __init__(
        self,
        model_dir: str | pathlib.Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        max_batch_images: int = 32,
        output_device: str = "cpu",
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if max_batch_images < 1:
            raise ValueError("max_batch_images must be >= 1")
        self.model_dir = pathlib.Path(model_dir)
        self.dtype: torch.dtype = _DTYPES[dtype]
        self.device = torch.device(device)
        # where embeddings are returned: the CPU (for the shared-memory ring) or the tower's own GPU
        # (for a CUDA ring: the bytes then never leave the device)
        self.output_device = torch.device(output_device)
        self.max_batch_images = max_batch_images

        from transformers import AutoConfig, AutoImageProcessor

        from epdq.engines.remote_code import prepare_remote_code

        prepare_remote_code(self.model_dir)
        config = AutoConfig.from_pretrained(self.model_dir, trust_remote_code=True)
        if config.model_type not in _VISION_CLASSES:
            raise ValueError(
                f"unsupported model_type {config.model_type!r}; known: {sorted(_VISION_CLASSES)}"
            )
        self._vision_config = config.vision_config
        self.merge_size = int(self._vision_config.spatial_merge_size)
        self.processor = AutoImageProcessor.from_pretrained(self.model_dir, trust_remote_code=True)
        weights = _read_vision_weights(self.model_dir)
        from epdq.engines.base import MODEL_LOAD_LOCK

        with MODEL_LOAD_LOCK:
            self.model = _build_tower(config, weights)
        # Cast parameters only: casting the module would also cast the rotary inv_freq buffers,
        # and bf16 embeddings would then drift from the full model's (notes/vllm-cpu.md).
        for p in self.model.parameters():
            p.data = p.data.to(self.dtype)
        self.model.to(self.device)
        self.hidden_size = int(
            getattr(self._vision_config, "out_hidden_size", None) or self._vision_config.hidden_size
        )
        self.scope = _scope(weights, self._vision_config, self.processor, dtype)
        del weights

    def preprocess(self, images: list[PIL.Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixels -> (patches [sum(t*h*w), C*T*P*P], grid_thw [n, 3]); bad input -> InvalidInputError."""
        from PIL import Image

        if not images:
            raise InvalidInputError("no images to encode")
        if len(images) > self.max_batch_images:
            raise InvalidInputError(f"{len(images)} images exceed max_batch_images={self.max_batch_images}")
        for i, im in enumerate(images):
            if not isinstance(im, Image.Image):
                raise InvalidInputError(f"image {i} is {type(im).__name__}, not a PIL image")
            if im.width < 1 or im.height < 1:
                raise InvalidInputError(f"image {i} is empty ({im.width}x{im.height})")
        try:
            out = self.processor(images=list(images), return_tensors="pt")
        except (ValueError, TypeError, OSError) as exc:
            raise InvalidInputError(f"image preprocessing failed: {exc}") from exc
        return out["pixel_values"], out["image_grid_thw"].to(torch.int64)

    def expected_rows(self, grid_thw: torch.Tensor) -> list[int]:
        return [int(t * h * w) // self.merge_size**2 for t, h, w in grid_thw.tolist()]

    @torch.inference_mode()
    def encode(self, images: list[PIL.Image.Image]) -> list[EncodedImage]:
        pixels, grid = self.preprocess(images)
        out = self.model(pixels.to(self.device, self.dtype), grid_thw=grid.to(self.device))
        embeds = getattr(out, "pooler_output", out)  # older transformers return the tensor itself
        embeds = embeds.to(self.output_device)
        rows = self.expected_rows(grid)
        if embeds.shape[0] != sum(rows) or embeds.shape[1] != self.hidden_size:
            raise RuntimeError(
                f"vision tower returned {tuple(embeds.shape)}, expected ({sum(rows)}, {self.hidden_size})"
            )
        # Refused here, before the ring: published, NaN/inf embeddings would be served from the
        # cache to every request with this image, and vLLM decodes them into garbage without an
        # error. Checked once per encode, not per hand-off to a PD engine.
        if not torch.isfinite(embeds).all():
            row = int((~torch.isfinite(embeds)).any(dim=1).nonzero()[0])
            image = next(i for i, end in enumerate(itertools.accumulate(rows)) if row < end)
            raise EngineError(
                f"the vision tower produced NaN or infinite embeddings for image {image} of {len(rows)} "
                f"(in {str(self.dtype).removeprefix('torch.')}: an overflow?)"
            )
        return [
            EncodedImage(embeds=chunk.contiguous(), grid_thw=tuple(g))
            for chunk, g in zip(torch.split(embeds, rows), grid.tolist(), strict=True)
        ]


def _weight_files(model_dir: pathlib.Path) -> Iterator[tuple[pathlib.Path, list[str] | None]]:
    """(file, names to read or None for 'scan all') for a single or sharded safetensors checkpoint."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        by_file: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            if name.startswith(_PREFIXES):
                by_file.setdefault(fname, []).append(name)
        for fname in sorted(by_file):
            yield model_dir / fname, sorted(by_file[fname])
        return
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    yield single, None


def _read_vision_weights(model_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    for path, names in _weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in names if names is not None else f.keys():
                prefix = next((p for p in _PREFIXES if name.startswith(p)), None)
                if prefix is not None:
                    weights[name[len(prefix) :]] = f.get_tensor(name)
    if not weights:
        raise ValueError(f"no vision tower tensors ({' or '.join(_PREFIXES)}*) in {model_dir}")
    return weights


def _build_tower(config, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    import importlib

    module_name, class_name = _VISION_CLASSES[config.model_type]
    cls = getattr(importlib.import_module(module_name), class_name)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: random init is only slower, not wrong
        import contextlib

        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        model = cls._from_config(config.vision_config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"vision weights do not match the tower: missing={missing[:5]} unexpected={unexpected[:5]}"
        )
    return model.eval()


def _scope(weights: dict[str, torch.Tensor], vision_config, processor, dtype: str) -> str:
    """Hash of the tower's weight bytes, its config and the processor settings."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(weights):
        t = weights[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    cfg = vision_config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "architectures"):
        cfg.pop(volatile, None)
    proc = processor.to_dict()
    proc.pop("processor_class", None)
    proc["__class__"] = type(processor).__name__
    h.update(
        json.dumps({"vision": cfg, "processor": proc, "dtype": dtype}, sort_keys=True, default=str).encode()
    )
    return h.hexdigest()
