"""PDEngine on plain transformers: the full Qwen2-VL / Qwen2.5-VL model decoding in this process.

mode "pd": requests carry precomputed `image_embeds` [N, hidden] (images concatenated in prompt
order) and `image_grid_thw` [n, 3]; the vision tower's weights are loaded but never run.
mode "both": requests carry PIL images; the image processor makes patches and the model's own
`get_image_features` encodes them (the colocated reference).

How the embeddings get in: the prompt's un-expanded `<|image_pad|>` (one per image, what
`render_prompt` returns, the same text vLLM takes) is expanded here to t*h*w/merge^2 copies, the
ids are embedded with the model's token embedding, and the image rows are scattered into the
image-token positions (`masked_scatter`, exactly what `Qwen2VLModel.forward` does with the
output of `get_image_features`). M-RoPE positions come from the model's own `get_rope_index`
(input ids + token types + grid), computed per request and passed explicitly as `position_ids`,
so the model's shared `rope_deltas` attribute is never used and requests cannot disturb each
other. Decoding is a manual loop with a per-request KV cache: one forward per step, each step
off the event loop (`asyncio.to_thread`), steps of concurrent requests serialised by a lock, and
`abort` takes effect between steps. Greedy output is token-identical to vLLM in float32.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import threading
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Literal

from epdq.engines.base import (
    IMAGE_PLACEHOLDER,
    Delta,
    SamplingSpec,
    embed_rows,
    engine_temperature,
    render_chat_prompt,
)
from epdq.errors import CancelledError, EngineError, InvalidInputError

if TYPE_CHECKING:
    import PIL.Image
    import torch

_DTYPES = ("float32", "bfloat16", "float16")
_REPLACEMENT_CHAR = "\ufffd"


class HFPDEngine:
    """PDEngine (see `epdq.engines.base.PDEngine`) on a transformers Qwen2-VL family model."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        mode: Literal["pd", "both"] = "pd",
        dtype: str = "float32",
        device: str = "cpu",
        max_model_len: int = 4096,
        max_images_per_prompt: int = 8,
    ) -> None:
        if mode not in ("pd", "both"):
            raise ValueError(f"mode must be 'pd' or 'both', got {mode!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
        if max_model_len < 16:
            raise ValueError("max_model_len must be >= 16")
        if not 0 <= max_images_per_prompt <= 256:
            raise ValueError("max_images_per_prompt must be in [0, 256]")
        self.model_dir = pathlib.Path(model_dir).absolute()
        self.mode = mode
        self.dtype_name = dtype
        self.device = device
        self.max_model_len = max_model_len
        self.max_images_per_prompt = max_images_per_prompt

        from transformers import AutoConfig, AutoTokenizer

        from epdq.engines.remote_code import prepare_remote_code

        prepare_remote_code(self.model_dir)
        self._config = AutoConfig.from_pretrained(self.model_dir, trust_remote_code=True)
        text_config = getattr(self._config, "text_config", self._config)
        self.hidden_size: int = int(text_config.hidden_size)
        self.merge_size: int = int(self._config.vision_config.spatial_merge_size)
        self.image_token_id: int = int(self._config.image_token_id)
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir, trust_remote_code=True)
        self._eos_ids = self._find_eos_ids()
        self._model = None
        self._image_processor = None
        self._lock = threading.Lock()  # one forward at a time (per-request caches, shared weights)
        self._active: set[str] = set()
        self._aborted: set[str] = set()

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self._model is None:
            await asyncio.to_thread(self._load)

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForImageTextToText

        from epdq.engines.base import MODEL_LOAD_LOCK

        dtype = getattr(torch, self.dtype_name)
        model = None
        with MODEL_LOAD_LOCK:
            if self.device != "cpu":
                # straight onto the GPU: no full copy of the weights in host memory first
                with contextlib.suppress(ImportError, ValueError, TypeError):
                    model = AutoModelForImageTextToText.from_pretrained(
                        self.model_dir, dtype=dtype, trust_remote_code=True, device_map={"": self.device}
                    )
            if model is None:
                model = AutoModelForImageTextToText.from_pretrained(
                    self.model_dir, dtype=dtype, trust_remote_code=True
                )
            if any(p.is_meta for p in model.parameters()):
                model.tie_weights()  # a tied lm_head (not in the checkpoint) left unmaterialised
            unloaded = [n for n, p in model.named_parameters() if p.is_meta]
            if unloaded:
                raise EngineError(f"{len(unloaded)} weights were not loaded from {self.model_dir}: {unloaded[:4]}")
        model.to(self.device).eval()
        if self.mode == "both":
            from transformers import AutoImageProcessor

            self._image_processor = AutoImageProcessor.from_pretrained(self.model_dir, trust_remote_code=True)
        self._model = model

    async def close(self) -> None:
        for rid in list(self._active):
            self._aborted.add(rid)
        self._model = None
        self._image_processor = None

    def _find_eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        if self._tokenizer.eos_token_id is not None:
            ids.add(int(self._tokenizer.eos_token_id))
        with contextlib.suppress(Exception):
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
            ids.update([eos] if isinstance(eos, int) else list(eos or []))
        return frozenset(ids)

    # -- prompts ---------------------------------------------------------------------------
    def render_prompt(self, messages: list[dict]) -> str:
        return render_chat_prompt(self._tokenizer, messages, self.max_images_per_prompt)

    def expected_embed_rows(self, grid_thw: Sequence[Sequence[int]] | torch.Tensor) -> int:
        return embed_rows(grid_thw, self.merge_size)

    # -- generation ------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: str,
        sampling: SamplingSpec,
        *,
        image_embeds: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        images: list[PIL.Image.Image] | None = None,
    ) -> AsyncIterator[Delta]:
        if self._model is None:
            raise EngineError("engine not started", request_id=request_id)
        if not isinstance(sampling, SamplingSpec):
            raise InvalidInputError("sampling must be a SamplingSpec", request_id=request_id)
        embeds, grid = await self._image_inputs(request_id, prompt, image_embeds, image_grid_thw, images)
        if request_id in self._active:
            raise InvalidInputError(f"request id {request_id!r} is already running", request_id=request_id)
        self._active.add(request_id)
        self._aborted.discard(request_id)
        try:
            async for delta in self._decode(request_id, prompt, sampling, embeds, grid):
                yield delta
        finally:
            self._active.discard(request_id)
            self._aborted.discard(request_id)

    async def abort(self, request_id: str) -> None:
        if request_id in self._active:
            self._aborted.add(request_id)

    async def forget_cached_inputs(self) -> None:
        """Nothing to forget: every request prefills from its own embeddings, nothing is kept
        across requests (see VllmEngine.forget_cached_inputs)."""

    async def _image_inputs(self, request_id, prompt, image_embeds, image_grid_thw, images):
        """Validate the request's image inputs -> (embeds [N, hidden] or None, grid [n, 3] or None)."""
        if not isinstance(prompt, str) or not prompt:
            raise InvalidInputError("prompt must be a non-empty string", request_id=request_id)
        n = prompt.count(IMAGE_PLACEHOLDER)
        if n > self.max_images_per_prompt:
            raise InvalidInputError(
                f"{n} images exceed max_images_per_prompt={self.max_images_per_prompt}", request_id=request_id
            )
        if self.mode == "both":
            if image_embeds is not None or image_grid_thw is not None:
                raise InvalidInputError("a 'both' engine takes images, not embeddings", request_id=request_id)
            images = list(images or [])
            if len(images) != n:
                raise InvalidInputError(
                    f"{len(images)} images for {n} image placeholders in the prompt", request_id=request_id
                )
            if not images:
                return None, None
            return await asyncio.to_thread(self._encode_images, request_id, images)
        if images:
            raise InvalidInputError("a 'pd' engine takes image embeddings, not images", request_id=request_id)
        if image_embeds is None and image_grid_thw is None:
            if n:
                raise InvalidInputError(
                    f"prompt has {n} image placeholders but no embeddings", request_id=request_id
                )
            return None, None
        return self._check_embeds(request_id, image_embeds, image_grid_thw, n)

    def _check_embeds(self, request_id, embeds, grid, n_placeholders: int):
        import torch

        if not isinstance(embeds, torch.Tensor) or not isinstance(grid, torch.Tensor):
            raise InvalidInputError(
                "image_embeds and image_grid_thw must both be tensors", request_id=request_id
            )
        if grid.dim() != 2 or grid.shape[1] != 3 or grid.dtype.is_floating_point or grid.dtype == torch.bool:
            raise InvalidInputError(
                f"image_grid_thw must be an integer [n, 3] tensor, got {tuple(grid.shape)}",
                request_id=request_id,
            )
        if grid.shape[0] != n_placeholders:
            raise InvalidInputError(
                f"{grid.shape[0]} grids for {n_placeholders} image placeholders in the prompt",
                request_id=request_id,
            )
        m = self.merge_size
        for t, h, w in grid.tolist():
            if t < 1 or h < m or w < m or h % m or w % m:
                raise InvalidInputError(
                    f"invalid grid [{t}, {h}, {w}] for merge size {m}", request_id=request_id
                )
        rows = self.expected_embed_rows(grid)
        if embeds.dim() != 2 or embeds.shape[0] != rows or embeds.shape[1] != self.hidden_size:
            raise InvalidInputError(
                f"image_embeds shape {tuple(embeds.shape)} != expected ({rows}, {self.hidden_size})",
                request_id=request_id,
            )
        if not embeds.dtype.is_floating_point:
            raise InvalidInputError(
                f"image_embeds must be floating point, got {embeds.dtype}", request_id=request_id
            )
        if not torch.isfinite(embeds).all():
            raise InvalidInputError("image_embeds contain NaN or infinity", request_id=request_id)
        return embeds, grid.to(torch.int64)

    def _encode_images(self, request_id, images):
        """mode "both": pixels -> the model's own vision tower -> (embeds, grid)."""
        import torch
        from PIL import Image

        if any(not isinstance(im, Image.Image) for im in images):
            raise InvalidInputError("images must be PIL images", request_id=request_id)
        try:
            out = self._image_processor(images=images, return_tensors="pt")
        except (ValueError, TypeError, OSError) as exc:
            raise InvalidInputError(f"image preprocessing failed: {exc}", request_id=request_id) from exc
        grid = out["image_grid_thw"].to(torch.int64)
        with self._lock, torch.inference_mode():
            feats = self._model.model.get_image_features(
                out["pixel_values"].to(self.device), grid.to(self.device), return_dict=True
            ).pooler_output
        return torch.cat(list(feats), dim=0), grid

    # -- the decode loop -------------------------------------------------------------------
    async def _decode(self, request_id, prompt, sampling: SamplingSpec, embeds, grid) -> AsyncIterator[Delta]:
        import torch

        state = await asyncio.to_thread(self._prefill, request_id, prompt, embeds, grid)
        generator = None
        if engine_temperature(sampling.temperature) > 0.0:
            generator = torch.Generator(device="cpu")
            if sampling.seed is not None:
                generator.manual_seed(sampling.seed)
            else:
                generator.seed()
        prompt_len = state["prompt_len"]
        budget = min(sampling.max_tokens, self.max_model_len - prompt_len)
        tokens: list[int] = []
        emitted = ""  # text already yielded
        logits = state["logits"]
        while True:
            if request_id in self._aborted:
                raise CancelledError("request aborted", request_id=request_id)
            token = _sample(logits, sampling, generator)
            tokens.append(token)
            reason = None
            text = self._tokenizer.decode(tokens, skip_special_tokens=True)
            if not sampling.ignore_eos and token in self._eos_ids:
                reason = "stop"
            else:
                cut = _find_stop(text, sampling.stop, len(emitted))
                if cut is not None:
                    text, reason = text[:cut], "stop"
                elif len(tokens) >= budget:
                    reason = "length"
            if reason is None:
                visible = _hold_back(text, sampling.stop)
            else:
                visible = text.rstrip(_REPLACEMENT_CHAR) if text.endswith(_REPLACEMENT_CHAR) else text
            new_text = visible[len(emitted) :] if visible.startswith(emitted) else ""
            emitted += new_text
            yield Delta([token], new_text, reason, prompt_len if reason is not None else 0)
            if reason is not None:
                return
            if request_id in self._aborted:
                raise CancelledError("request aborted", request_id=request_id)
            logits = await asyncio.to_thread(self._step, state, token, prompt_len + len(tokens) - 1)

    def _prefill(self, request_id, prompt, embeds, grid) -> dict:
        import torch

        model = self._model
        if model is None:
            raise EngineError("engine closed", request_id=request_id)
        if grid is not None:
            pieces = prompt.split(IMAGE_PLACEHOLDER)
            counts = [int(t) * int(h) * int(w) // self.merge_size**2 for t, h, w in grid.tolist()]
            expanded = pieces[0] + "".join(
                IMAGE_PLACEHOLDER * c + p for c, p in zip(counts, pieces[1:], strict=True)
            )
        else:
            expanded = prompt
        ids = self._tokenizer(expanded, return_tensors="pt")["input_ids"]
        n_image_tokens = int((ids == self.image_token_id).sum())
        expected = 0 if embeds is None else embeds.shape[0]
        if n_image_tokens != expected:
            raise InvalidInputError(
                f"prompt has {n_image_tokens} image tokens after expansion, embeddings have {expected} rows",
                request_id=request_id,
            )
        if ids.shape[1] >= self.max_model_len:
            raise InvalidInputError(
                f"prompt of {ids.shape[1]} tokens does not fit max_model_len={self.max_model_len}",
                request_id=request_id,
            )
        ids = ids.to(self.device)
        with self._lock, torch.inference_mode(), self._decoder_attention():
            inputs_embeds = model.get_input_embeddings()(ids)
            if embeds is not None:
                mask = (ids == self.image_token_id).unsqueeze(-1).expand_as(inputs_embeds)
                inputs_embeds = inputs_embeds.masked_scatter(
                    mask, embeds.to(inputs_embeds.device, inputs_embeds.dtype)
                )
                token_types = (ids == self.image_token_id).to(torch.int32)
                position_ids, delta = model.model.get_rope_index(
                    ids, mm_token_type_ids=token_types, image_grid_thw=grid.to(self.device)
                )
                delta = int(delta.reshape(-1)[0])
            else:
                position_ids = torch.arange(ids.shape[1], device=ids.device).view(1, 1, -1).expand(3, 1, -1)
                delta = 0
            out = model(
                inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=True, logits_to_keep=1
            )
        return {
            "cache": out.past_key_values,
            "delta": delta,
            "prompt_len": int(ids.shape[1]),
            "logits": out.logits[0, -1].float(),
        }

    def _decoder_attention(self):
        """The SDPA backends the decoder may use: on CUDA, not cuDNN.

        Measured on an H200 (torch 2.11, bench/results/gpu/2026-12-04T1521-h200): with cuDNN
        chosen, every decode step spent 58.8 ms of host time in `_cudnn_attention_forward` (36
        layers, 1.6 ms each; the key length changes every step) against 4.4 ms of device time for
        the whole step. Both routes (PD and colocated) run this same code, so token equality holds.
        """
        if not str(self.device).startswith("cuda"):
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    def _step(self, state: dict, token: int, seq_index: int):
        """Feed one token at sequence index `seq_index` -> next logits."""
        import torch

        model = self._model
        if model is None:
            raise EngineError("engine closed")
        ids = torch.tensor([[token]], device=self.device)
        position_ids = torch.full((3, 1, 1), seq_index + state["delta"], device=self.device, dtype=torch.long)
        with self._lock, torch.inference_mode(), self._decoder_attention():
            out = model(
                inputs_embeds=model.get_input_embeddings()(ids),
                position_ids=position_ids,
                past_key_values=state["cache"],
                use_cache=True,
                logits_to_keep=1,
            )
        state["cache"] = out.past_key_values
        return out.logits[0, -1].float()


def _sample(logits, s: SamplingSpec, generator) -> int:
    import torch

    # As VllmEngine sends it to vLLM: greedy below base.GREEDY_BELOW, at least 0.01 above (a valid
    # 1e-40 made logits / temperature overflow to inf, softmax NaN, and the request an EngineError)
    temperature = engine_temperature(s.temperature)
    if temperature == 0.0 or generator is None:
        return int(torch.argmax(logits))
    # the generator lives on the CPU: seeded sampling is the same on any device; float32, as
    # float16 logits divided by a small temperature overflow to inf (then NaN probabilities)
    logits = logits.cpu().float()
    probs = torch.softmax(logits / temperature, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < s.top_p  # always keeps the top token
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def _find_stop(text: str, stops: tuple[str, ...], emitted_len: int) -> int | None:
    """Index where the earliest stop string starts (searching text not yet emitted), or None."""
    best = None
    for stop in stops:
        i = text.find(stop, max(0, emitted_len - len(stop) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best


def _hold_back(text: str, stops: tuple[str, ...]) -> str:
    """Text safe to stream now: no partial UTF-8 character, no tail that may start a stop string."""
    end = len(text)
    while end and text[end - 1] == _REPLACEMENT_CHAR:
        end -= 1
    text = text[:end]
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    return text[: len(text) - hold]
