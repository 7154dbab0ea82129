"""PDEngine on vLLM's AsyncLLM (v1): prefill + decode, fed precomputed image embeddings.

mode "pd": the engine never builds the vision tower; requests carry `image_embeds` (one tensor,
images concatenated in prompt order) and `image_grid_thw` [n, 3].
mode "both": the colocated baseline; requests carry PIL images and vLLM encodes them itself.

vLLM runs the model in processes it spawns (EngineCore, model inspection). Spawned children
re-import the parent's __main__ module, so a script that creates an engine must do it under
`if __name__ == "__main__":`. A wrong embedding shape kills the EngineCore for good, so every
request is validated here before it is submitted; a dead core surfaces as `EngineError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import os
import pathlib
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from epdq.engines import rpc_dirs
from epdq.engines.base import (
    IMAGE_PLACEHOLDER,
    Delta,
    SamplingSpec,
    embed_rows,
    engine_temperature,
    render_chat_prompt,
)
from epdq.errors import CancelledError, ConfigError, EngineError, InvalidInputError

if TYPE_CHECKING:
    import PIL.Image
    import torch

_DTYPES = ("float32", "bfloat16", "float16")
# The KV cache of an engine on the CPU when none is asked for: enough for the tiny model's many
# sequences, little enough for several engines on a small machine (vLLM's own CPU default is
# VLLM_CPU_KVCACHE_SPACE, gigabytes). On a GPU vLLM sizes it (gpu_memory_utilization).
CPU_KV_CACHE_BYTES = 64 * 2**20
# Process-wide defaults vLLM's children inherit; a value the user exported always wins.
_ENV_DEFAULTS = {
    "OMP_NUM_THREADS": "1",  # 2 OMP threads on 2 cores made engines 20-30x slower
    "EPDQ_DIE_WITH_PARENT": "1",  # engine processes exit when their worker dies (vllm_plugin)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # otherwise every engine on a host pins to core 0
    "HF_HUB_OFFLINE": "1",
}
_RPC_ENV = "VLLM_RPC_BASE_PATH"
WORKER_PID_ENV = "EPDQ_WORKER_PID"
_owned_rpc_dirs: set[str] = set()


@dataclass(slots=True)
class VllmEngineConfig:
    mode: Literal["pd", "both"]
    dtype: str = "float32"
    max_model_len: int = 2048
    max_num_seqs: int = 8
    # None: CPU_KV_CACHE_BYTES on the CPU, vLLM's own sizing (gpu_memory_utilization) on a GPU
    kv_cache_bytes: int | None = None
    max_images_per_prompt: int = 8

    def __post_init__(self) -> None:
        if self.mode not in ("pd", "both"):
            raise ValueError(f"mode must be 'pd' or 'both', got {self.mode!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.max_model_len < 16 or self.max_num_seqs < 1:
            raise ValueError("max_model_len must be >= 16 and max_num_seqs >= 1")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 2**20:
            raise ValueError("kv_cache_bytes must be at least 1 MiB")
        if not 0 <= self.max_images_per_prompt <= 256:
            raise ValueError("max_images_per_prompt must be in [0, 256]")


class VllmEngine:
    """PDEngine (see `epdq.engines.base.PDEngine`) backed by `vllm.v1.engine.async_llm.AsyncLLM`."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        mode: Literal["pd", "both"],
        dtype: str = "float32",
        max_model_len: int = 2048,
        max_num_seqs: int = 8,
        kv_cache_bytes: int | None = None,
        max_images_per_prompt: int = 8,
    ) -> None:
        self.config = VllmEngineConfig(
            mode, dtype, max_model_len, max_num_seqs, kv_cache_bytes, max_images_per_prompt
        )
        self.model_dir = pathlib.Path(model_dir).absolute()
        self.mode = mode
        from transformers import AutoConfig, AutoTokenizer

        from epdq.engines.remote_code import prepare_remote_code

        prepare_remote_code(self.model_dir)
        hf_config = AutoConfig.from_pretrained(self.model_dir, trust_remote_code=True)
        text_config = getattr(hf_config, "text_config", hf_config)
        self.hidden_size: int = int(text_config.hidden_size)
        self.merge_size: int = int(hf_config.vision_config.spatial_merge_size)
        self.kv_bytes_per_token = kv_bytes_per_token(text_config, dtype)
        if kv_cache_bytes is not None:  # before vLLM starts (a minute or more) only to refuse it
            check_kv_cache(kv_cache_bytes, self.kv_bytes_per_token, max_model_len)
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir, trust_remote_code=True)
        self._llm = None
        self._rpc_dir: str | None = None
        self._rpc_lock = -1  # the fd whose lock marks _rpc_dir as in use
        self._dead: BaseException | None = None
        self._active: set[str] = set()
        self._start_cancelled = threading.Event()

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Create the engine: its EngineCore process imports vLLM, loads the model and profiles it
        (10-20 s here, minutes for a large model on a GPU). Cancelled (a worker told to stop while
        it starts), it stops those processes, so the start ends at once rather than after the load."""
        if self._llm is not None:
            return
        from epdq.engines import vllm_plugin

        vllm_plugin.install()  # this process; vLLM's children get it via the entry point
        self._prepare_env()
        before = {p.pid for p in multiprocessing.active_children()}
        # Off the event loop: creation blocks until the EngineCore is ready.
        creating = asyncio.ensure_future(asyncio.to_thread(self._create))
        try:
            await asyncio.shield(creating)
        except asyncio.CancelledError:
            self._start_cancelled.set()  # the thread stops at its next step
            # The thread cannot be interrupted; the processes it waits for can, and their end
            # ends its wait ("Engine core initialization failed"). It may not have started them
            # yet (it builds the config first), so look again until it gives up. Before its
            # handshake a core does not notice its worker's exit: it would wait 5 minutes for it.
            with contextlib.suppress(BaseException):
                while not creating.done():
                    await asyncio.to_thread(_stop_children, before)
                    await asyncio.wait((creating,), timeout=0.1)
            with contextlib.suppress(BaseException):
                await creating
            await self.close()  # in case it was created all the same; removes the RPC directory
            raise
        except BaseException:
            self._release_rpc_dir()
            raise

    def _create(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        self._check_not_cancelled()  # those imports take seconds; the steps below more
        args = AsyncEngineArgs(**self.engine_args(on_cpu=current_platform.is_cpu()))
        with _uni_executor_on_cpu():
            vllm_config = args.create_engine_config()
        self._check_not_cancelled()
        # Stored, not returned: a returned engine stays referenced by the finished futures, and
        # its __del__ would then run at interpreter exit, when vLLM's modules are gone.
        self._llm = AsyncLLM.from_vllm_config(vllm_config, disable_log_stats=True)

    def engine_args(self, *, on_cpu: bool) -> dict:
        """vLLM's AsyncEngineArgs for this engine; ConfigError if its KV cache cannot hold one
        sequence of max_model_len tokens (vLLM would refuse it only after loading the model)."""
        cfg = self.config
        limit = {"image": 0 if cfg.mode == "pd" else cfg.max_images_per_prompt, "video": 0}
        args = dict(
            model=str(self.model_dir),
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            limit_mm_per_prompt=limit,
            enable_mm_embeds=cfg.mode == "pd",
            distributed_executor_backend="uni",
            enforce_eager=True,
            disable_log_stats=True,
            trust_remote_code=True,
            seed=0,
        )
        kv = cfg.kv_cache_bytes if cfg.kv_cache_bytes is not None else CPU_KV_CACHE_BYTES if on_cpu else None
        if kv is not None:
            check_kv_cache(kv, self.kv_bytes_per_token, cfg.max_model_len)
            args["kv_cache_memory_bytes"] = kv
        return args

    def _check_not_cancelled(self) -> None:
        if self._start_cancelled.is_set():
            raise _StartCancelled("the engine's start was cancelled")

    def _prepare_env(self) -> None:
        for key, value in _ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        # whose children vLLM's processes are: one that finds this process gone when it starts
        # (killed while the child was starting) exits at once (vllm_plugin.watch_parent)
        os.environ[WORKER_PID_ENV] = str(os.getpid())
        plugins = os.environ.get("VLLM_PLUGINS")
        if plugins is not None and "epdq_torchvision_shim" not in plugins.split(","):
            os.environ["VLLM_PLUGINS"] = ",".join(p for p in (plugins, "epdq_torchvision_shim") if p)
        current = os.environ.get(_RPC_ENV)
        if current is None or current in _owned_rpc_dirs:
            # vLLM leaves its ipc socket files behind; keep them in a private dir we can remove.
            rpc_dirs.remove_stale()  # those of workers that were SIGKILLed
            self._rpc_dir, self._rpc_lock = rpc_dirs.make()
            _owned_rpc_dirs.add(self._rpc_dir)
            os.environ[_RPC_ENV] = self._rpc_dir

    def _release_rpc_dir(self) -> None:
        if self._rpc_dir is None:
            return
        rpc_dirs.release(self._rpc_dir, self._rpc_lock)
        _owned_rpc_dirs.discard(self._rpc_dir)
        if os.environ.get(_RPC_ENV) == self._rpc_dir:
            del os.environ[_RPC_ENV]
        self._rpc_dir = None

    async def close(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            # End in-flight streams first (their consumers get CancelledError), then stop the
            # output handler so it does not log the core's exit as a failure.
            if self._active:
                with contextlib.suppress(Exception):
                    await llm.abort(list(self._active))
                await asyncio.sleep(0)
            handler = getattr(llm, "output_handler", None)
            if handler is not None and not handler.done():
                handler.cancel()
                await asyncio.wait([handler], timeout=5)
            await asyncio.to_thread(llm.shutdown)
            await asyncio.sleep(0)  # shutdown closes the client's sockets through this loop
            _destroy_zmq_context(llm)
            del llm
            gc.collect()  # AsyncLLM.__del__ shuts down again; let it run now, not at interpreter exit
        self._release_rpc_dir()

    @property
    def dead(self) -> bool:
        return self._dead is not None or (self._llm is not None and bool(self._llm.errored))

    @property
    def dead_reason(self) -> str:
        if self._dead is not None:
            return f"{type(self._dead).__name__}: {self._dead}"[:200]
        return "vLLM's engine core died" if self.dead else ""

    # -- prompts ---------------------------------------------------------------------------
    def render_prompt(self, messages: list[dict]) -> str:
        return render_chat_prompt(self._tokenizer, messages, self.config.max_images_per_prompt)

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
        if self._dead is not None:
            raise EngineError(f"engine is dead: {self._dead}", request_id=request_id)
        if self._llm is None:
            raise EngineError("engine not started", request_id=request_id)
        if self._llm.errored:
            self._dead = self._llm.dead_error
            raise EngineError(f"engine is dead: {self._dead}", request_id=request_id)
        request = {"prompt": prompt}
        mm = self._multimodal_data(prompt, image_embeds, image_grid_thw, images)
        if mm is not None:
            request["multi_modal_data"] = mm
        params = self._sampling_params(sampling)
        if request_id in self._active:
            raise InvalidInputError(f"request id {request_id!r} is already running", request_id=request_id)
        self._active.add(request_id)
        try:
            async with contextlib.aclosing(self._llm.generate(request, params, request_id)) as stream:
                async for delta in self._deltas(request_id, stream):
                    yield delta
        finally:
            self._active.discard(request_id)

    async def _deltas(self, request_id: str, stream) -> AsyncIterator[Delta]:
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        try:
            async for out in stream:
                completion = out.outputs[0]
                reason = completion.finish_reason if out.finished else None
                if reason == "abort":
                    raise CancelledError("request aborted", request_id=request_id)
                if reason == "error":
                    raise EngineError("engine reported a request error", request_id=request_id)
                if reason is not None and reason not in ("stop", "length"):
                    reason = "stop"  # e.g. "repetition": the model stopped on its own
                if completion.token_ids or completion.text or reason is not None:
                    n_prompt = len(out.prompt_token_ids or ()) if reason is not None else 0
                    yield Delta(list(completion.token_ids), completion.text, reason, n_prompt)
        except EngineDeadError as exc:
            self._dead = exc
            raise EngineError(f"vLLM engine core died: {exc}", request_id=request_id) from exc
        except (VLLMClientError, ValueError) as exc:
            raise InvalidInputError(str(exc), request_id=request_id) from exc
        except EngineGenerateError as exc:
            root = _root_cause(exc)
            if isinstance(root, ValueError) and _raised_in_input_processing(root):
                # vLLM wraps what its input processing rejects (an image whose aspect ratio the
                # processor refuses, ...): the request's input, not the engine, as on an E->PD route
                raise InvalidInputError(f"the engine refused the input: {root}", request_id=request_id) from exc
            raise EngineError(f"generation failed: {exc.__cause__ or exc}", request_id=request_id) from exc

    async def abort(self, request_id: str) -> None:
        if self._llm is not None and self._dead is None:
            with contextlib.suppress(Exception):
                await self._llm.abort(request_id)

    async def forget_cached_inputs(self) -> None:
        """Drop everything vLLM keeps keyed by a multimodal input's hash: the prefix cache (KV of
        prompts with that image), the front-end's and core's multimodal caches, the encoder cache.

        For embeddings that changed under vLLM (a ring entry handed over as a view and overwritten
        between vLLM's hash of it and its copy): their KV sits under the right image's hash, and the
        retry of the same image would reuse it. Call it once the request that read them has left the
        engine: requests still running are preempted and recomputed (vLLM's only way to clear
        blocks in use), and one still running with the wrong bytes would cache them again."""
        llm = self._llm
        if llm is None or self.dead:
            return
        # vLLM's own order (EngineCore._reset_caches, for new weights): the running requests'
        # blocks and encoder outputs are let go first; their encoder inputs are then recomputed
        if not await llm.reset_prefix_cache(reset_running_requests=True):
            raise EngineError("vLLM did not reset its prefix cache")
        await llm.reset_mm_cache()
        await llm.reset_encoder_cache()

    def _sampling_params(self, s: SamplingSpec):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            max_tokens=s.max_tokens,
            temperature=engine_temperature(s.temperature),
            top_p=s.top_p,
            seed=s.seed,
            stop=list(s.stop) or None,
            ignore_eos=s.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
        )

    def _multimodal_data(self, prompt, image_embeds, image_grid_thw, images) -> dict | None:
        if not isinstance(prompt, str) or not prompt:
            raise InvalidInputError("prompt must be a non-empty string")
        n_placeholders = prompt.count(IMAGE_PLACEHOLDER)
        if n_placeholders > self.config.max_images_per_prompt:
            raise InvalidInputError(
                f"{n_placeholders} images exceed max_images_per_prompt={self.config.max_images_per_prompt}"
            )
        if self.mode == "both":
            if image_embeds is not None or image_grid_thw is not None:
                raise InvalidInputError("a 'both' engine takes images, not embeddings")
            return _image_list(images, n_placeholders)
        if images:
            raise InvalidInputError("a 'pd' engine takes image embeddings, not images")
        if image_embeds is None and image_grid_thw is None:
            if n_placeholders:
                raise InvalidInputError(f"prompt has {n_placeholders} image placeholders but no embeddings")
            return None
        embeds, grid = self._check_embeds(image_embeds, image_grid_thw, n_placeholders)
        return {"image": {"image_embeds": embeds, "image_grid_thw": grid}}

    def _check_embeds(self, embeds, grid, n_placeholders: int):
        import torch

        if not isinstance(embeds, torch.Tensor) or not isinstance(grid, torch.Tensor):
            raise InvalidInputError("image_embeds and image_grid_thw must both be tensors")
        if grid.dim() != 2 or grid.shape[1] != 3 or grid.dtype.is_floating_point:
            raise InvalidInputError(
                f"image_grid_thw must be an integer [n, 3] tensor, got {tuple(grid.shape)}"
            )
        if grid.shape[0] != n_placeholders:
            raise InvalidInputError(
                f"{grid.shape[0]} grids for {n_placeholders} image placeholders in the prompt"
            )
        m = self.merge_size
        for t, h, w in grid.tolist():
            if t < 1 or h < m or w < m or h % m or w % m:
                raise InvalidInputError(f"invalid grid [{t}, {h}, {w}] for merge size {m}")
        rows = self.expected_embed_rows(grid)
        if embeds.dim() != 2 or embeds.shape[0] != rows or embeds.shape[1] != self.hidden_size:
            raise InvalidInputError(
                f"image_embeds shape {tuple(embeds.shape)} != expected ({rows}, {self.hidden_size})"
            )
        if not embeds.dtype.is_floating_point:
            raise InvalidInputError(f"image_embeds must be floating point, got {embeds.dtype}")
        dtype = getattr(torch, self.config.dtype)
        cast = embeds.to("cpu", dtype).contiguous()
        # vLLM runs on NaN/inf embeddings without a word (garbage tokens). Encoders refuse to
        # publish non-finite ones, so only a narrowing cast can make them (float32 beyond
        # float16's 65504 is inf); the common no-cast hand-off, a view of the ring, is not scanned.
        if embeds.dtype != dtype and not torch.isfinite(cast).all():
            raise InvalidInputError(
                f"image_embeds are not finite in {self.config.dtype} (NaN, or values beyond its range)"
            )
        return cast, grid.to("cpu", torch.int64).contiguous()


def kv_bytes_per_token(text_config, dtype: str) -> int:
    """KV-cache bytes one token takes in every layer (keys and values), as vLLM sizes them for a
    Qwen2-VL family model: full attention, the cache in the model's dtype."""
    heads = int(text_config.num_attention_heads)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    head_dim = getattr(text_config, "head_dim", None) or int(text_config.hidden_size) // heads
    itemsize = 4 if dtype == "float32" else 2
    return int(text_config.num_hidden_layers) * 2 * kv_heads * int(head_dim) * itemsize


def check_kv_cache(kv_cache_bytes: int, per_token: int, max_model_len: int) -> None:
    """vLLM refuses to start unless one sequence of max_model_len tokens fits in its KV cache (it
    also keeps a block back, so this is a lower bound): refuse sooner, saying what would fit."""
    need = per_token * max_model_len
    if kv_cache_bytes < need:
        raise ConfigError(
            f"a KV cache of {kv_cache_bytes / 2**20:g} MiB cannot hold one sequence of max_model_len="
            f"{max_model_len} tokens ({per_token} bytes each, at least {-(-need // 2**20)} MiB): give it more "
            f"(--kv-cache-mb) or lower max_model_len (--max-model-len; {kv_cache_bytes // per_token} tokens fit)"
        )


_env_lock = threading.Lock()


class _StartCancelled(Exception):
    """Ends the creating thread between its steps once `start` was cancelled."""


def _stop_children(before: set[int], timeout_s: float = 10.0) -> None:
    """SIGTERM the processes this process started (vLLM's EngineCore) since `before` was taken,
    then SIGKILL those still there after `timeout_s`."""
    import time

    new = [p for p in multiprocessing.active_children() if p.pid not in before]
    for p in new:
        with contextlib.suppress(Exception):
            p.terminate()
    end = time.monotonic() + timeout_s
    for p in new:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            with contextlib.suppress(Exception):
                p.kill()
            p.join(5)


def _destroy_zmq_context(llm) -> None:
    """vLLM's client closes its sockets but never terminates its zmq context, which then warns
    (ResourceWarning) when collected. Terminate it once every socket on it is closed."""
    ctx = getattr(getattr(llm, "engine_core", None), "ctx", None)
    if ctx is None:
        return
    for sock in list(getattr(ctx, "_sockets", ()) or ()):
        with contextlib.suppress(Exception):
            sock.close(linger=0)
    base = getattr(ctx, "_shadow_obj", None) or ctx  # an asyncio context shadows a sync one
    if not base.closed:
        with contextlib.suppress(Exception):
            base.destroy(linger=0)


@contextlib.contextmanager
def _uni_executor_on_cpu():
    """vLLM's CPU platform turns a "uni" executor into "mp" (one more process: +~6 s start,
    +~0.6 GB) unless V1 multiprocessing is off. AsyncLLM always runs its EngineCore in a
    separate process anyway, so the flag only matters to that check, made while the config is
    built: set it for that moment only (left set, a later `vllm.LLM` here would run in-process).
    The lock keeps engines started concurrently from restoring it under each other.
    """
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    with _env_lock:
        if key in os.environ:  # the user decided
            yield
            return
        os.environ[key] = "0"
        try:
            yield
        finally:
            os.environ.pop(key, None)


def _image_list(images, n_placeholders: int) -> dict | None:
    from PIL import Image

    images = list(images or [])
    if len(images) != n_placeholders:
        raise InvalidInputError(f"{len(images)} images for {n_placeholders} image placeholders in the prompt")
    if not images:
        return None
    if any(not isinstance(im, Image.Image) for im in images):
        raise InvalidInputError("images must be PIL images")
    return {"image": images}


def _raised_in_input_processing(exc: BaseException) -> bool:
    """Whether `exc` was raised by the processors that turn a request's images into model inputs
    (transformers' image processors, vLLM's multimodal processing): the input's fault. A ValueError
    from anywhere else in the engine is ours, and stays an EngineError."""
    tb = exc.__traceback__
    where = ""
    while tb is not None:
        where = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return any(part in where for part in ("/transformers/", "/vllm/multimodal/"))


def _root_cause(exc: BaseException) -> BaseException:
    seen = set()
    while exc.__cause__ is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__
    return exc
