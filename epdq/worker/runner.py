"""Build and run one worker process: engine, ring, broker link, until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import socket
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from epdq import protocol as P
from epdq.cpus import check_cpus
from epdq.engines import SUPPORTED_MODEL_TYPES
from epdq.errors import ConfigError, EngineError
from epdq.media import MAX_IMAGE_BYTES_LIMIT
from epdq.transport import ensure_private_dir, process_endpoint_problem
from epdq.worker.devices import check_device, resolve_dtype, resolve_ring, resolve_vllm_dtype
from epdq.worker.link import BrokerLink

log = logging.getLogger("epdq.worker")
T = TypeVar("T")

ROLES = ("encoder", "pd", "both")
ENCODER_MAX_BATCH = 8  # images per forward, by default; the encoder holds twice as many jobs


@dataclass(slots=True)
class WorkerConfig:
    role: str
    broker: str = "tcp://127.0.0.1:7700"
    model: str = ""  # checkpoint directory; empty = the embedded tiny model
    node: str = ""  # node id; workers with equal ids share rings (empty = hostname)
    worker_id: str = ""
    capacity: int = 0  # jobs held at once, the worker's credit at the broker (0 = role default)
    # encoder: images one forward takes at most (0 = ENCODER_MAX_BATCH, or the capacity if that is
    # smaller). An encoder holds two batches by default: while it runs one, the next is already
    # there, not a round trip through the broker away
    max_batch: int = 0
    ring_bytes: int = 256 * 2**20
    # auto: bfloat16 on a CUDA device, float32 on the CPU; for vLLM, wherever vLLM will run
    dtype: str = "auto"
    device: str = "cpu"  # cpu, cuda or cuda:N: where the vision tower / the hf PD engine run
    ring: str = "auto"  # encoder ring: auto (cuda on a CUDA device, else shm), shm or cuda
    fetch_bind: str = ""  # where an encoder serves ring bytes to other nodes ("" = see fetch_endpoint)
    # what PD workers on other nodes are told to connect to: HOST (the bound port is kept) or
    # tcp://HOST:PORT (NAT, port mapping); empty = the bound address, or for a wildcard bind the
    # address of the interface that routes to the broker
    fetch_advertise: str = ""
    # the broker enforces its --max-image-mb before a job reaches a worker: this is a backstop only
    max_image_bytes: int = MAX_IMAGE_BYTES_LIMIT
    max_image_pixels: int = 40_000_000
    max_model_len: int = 4096  # tokens of one sequence, prompt (image tokens included) and output
    # the vLLM engine's KV cache; 0: 64 MiB on the CPU (the tiny model), vLLM's own sizing on a
    # GPU (its gpu_memory_utilization share), where a real model needs far more
    kv_cache_bytes: int = 0
    max_images_per_prompt: int = 8
    heartbeat_s: float = 1.0
    keys_dir: str = ""  # CURVE keys (see epdq.keys); empty = the default directory if it exists
    insecure: bool = False  # plaintext tcp, allowed on loopback only
    threads: int = 1  # torch intra-op threads of an encoder (vLLM engines set their own)
    engine: str = "auto"  # auto: HF vision tower / vLLM; hf: transformers for PD too; noop: no model
    noop_encode_s: float = 0.0  # noop engine: seconds per image encoded
    noop_prefill_s: float = 0.0  # noop engine: seconds per prefill
    noop_token_s: float = 0.0  # noop engine: seconds per output token
    # SIGTERM: tell the broker to send nothing new and finish what is in hand, for at most this
    # long, before leaving (0: leave at once; what had not streamed is re-queued elsewhere)
    drain_timeout_s: float = 30.0
    # CPUs this process and what it starts (vLLM's engine core) run on; empty: wherever the
    # kernel puts them (see epdq.cpus)
    cpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.cpus = check_cpus(self.cpus)
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        problem = process_endpoint_problem(self.broker, connect=True) or (
            process_endpoint_problem(self.fetch_bind, connect=False) if self.fetch_bind else None
        )
        if problem:
            raise ValueError(problem)
        if self.capacity < 0 or self.capacity > 4096:
            raise ValueError("capacity must be in [0, 4096]")
        if not 0 <= self.max_batch <= 4096:
            raise ValueError("max_batch must be in [0, 4096]")
        if self.role != "encoder":
            if self.max_batch:
                raise ValueError(f"max_batch is an encoder's setting (images per forward), not a {self.role} worker's")
            if self.capacity == 0:
                self.capacity = 16
        else:
            if self.max_batch == 0:
                self.max_batch = min(ENCODER_MAX_BATCH, self.capacity or ENCODER_MAX_BATCH)
            if self.capacity == 0:
                self.capacity = min(4096, 2 * self.max_batch)
            if self.max_batch > self.capacity:
                raise ValueError(f"max_batch ({self.max_batch}) cannot exceed capacity ({self.capacity}): "
                                 "a forward takes only jobs the encoder holds")  # fmt: skip
        if not 2**20 <= self.ring_bytes <= 64 << 30:  # the ring's own bounds (epdq.ring.MAX_CAPACITY)
            raise ValueError("ring_bytes must be 1 MiB..64 GiB")
        if not 0.01 <= self.heartbeat_s <= 600:
            raise ValueError("heartbeat_s must be in [0.01, 600]")
        if self.engine not in ("auto", "hf", "noop"):
            raise ValueError(f"engine must be auto, hf or noop, got {self.engine!r}")
        if not all(0 <= v <= 60 for v in (self.noop_encode_s, self.noop_prefill_s, self.noop_token_s)):
            raise ValueError("noop delays must be in [0, 60] seconds")
        if not 0 <= self.drain_timeout_s <= 3600:
            raise ValueError("drain_timeout_s must be in [0, 3600]")
        if not 1 <= self.threads <= 1024:
            raise ValueError("threads must be in [1, 1024]")
        if not 16 <= self.max_model_len <= 1 << 20:
            raise ValueError(f"max_model_len must be in [16, {1 << 20}] tokens, got {self.max_model_len}")
        if self.kv_cache_bytes and not 2**20 <= self.kv_cache_bytes <= 1 << 40:
            raise ValueError(f"kv_cache_bytes must be 0 (automatic) or 1 MiB..1 TiB, got {self.kv_cache_bytes}")
        if self.kv_cache_bytes and (self.role == "encoder" or self.engine != "auto"):
            # only vLLM has a KV cache budget: elsewhere it would be silently ignored
            raise ValueError("kv_cache_bytes is a setting of the vLLM engine (--role pd or both, --engine auto)")
        if self.fetch_advertise:
            _check_advertise(self.fetch_advertise)
        if (self.fetch_bind or self.fetch_advertise) and self.role != "encoder":
            # only an encoder serves ring bytes: on another role they would be silently ignored
            raise ValueError("fetch_bind and fetch_advertise are encoder settings (only for --role encoder)")
        # device first: the ring and dtype defaults depend on it; a missing GPU fails here, at start-up
        self.device = check_device(self.device)
        self.ring = resolve_ring(self.ring, self.device)
        # vLLM finds a GPU by itself whatever --device says: its 'auto' is resolved when the engine
        # starts (resolve_vllm_dtype), not as float32 from the device default; so a config built
        # elsewhere (`epdq up`) carries 'auto' on to the worker, and needs no torch to do so
        vllm_on_default_device = self.role != "encoder" and self.engine == "auto" and self.device == "cpu"
        if self.dtype != "auto" or not vllm_on_default_device:
            self.dtype = resolve_dtype(self.dtype, self.device)
        self.node = self.node or socket.gethostname()
        if len(self.node) > 128:  # the broker refuses longer ones
            raise ValueError("node must be at most 128 characters")
        self.worker_id = self.worker_id or f"{self.role}-{self.node}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        if len(self.worker_id) > 128:
            raise ValueError("worker_id must be at most 128 characters")


def _check_checkpoint(model: str) -> None:
    # before any engine loads: an unsupported family would fail deep inside vLLM or transformers
    try:
        with open(os.path.join(model, "config.json"), "rb") as f:
            config = json.loads(f.read(1 << 20))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {model!r}/config.json: {e}") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{model!r} is a {model_type!r} checkpoint; epdq serves {', '.join(SUPPORTED_MODEL_TYPES)} (Qwen2-VL, Qwen2.5-VL)"
        )
    if not any(os.path.isfile(os.path.join(model, f)) for f in ("model.safetensors", "model.safetensors.index.json")):
        # a partial copy or download: vLLM would fail deep in its engine process
        raise ConfigError(f"{model!r} has no weights (model.safetensors or model.safetensors.index.json)")
    if not os.path.isfile(os.path.join(model, "preprocessor_config.json")):
        raise ConfigError(f"{model!r} has no preprocessor_config.json (the image processor's settings)")


def resolve_model(model: str) -> str:
    if model:
        if not os.path.isdir(model):
            raise ConfigError(f"model directory {model!r} does not exist")
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ConfigError(f"{model!r} has no config.json: not a Hugging Face checkpoint directory")
        _check_checkpoint(model)
        return model
    from epdq.models.tiny import default_model_dir

    return str(default_model_dir())


_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]{0,252})$")
_WILDCARDS = ("0.0.0.0", "*", "[::]", "::", "[*]")


def _check_advertise(value: str) -> None:
    host, port = value, None
    if value.startswith("tcp://"):
        host, sep, port = value[6:].rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"fetch_advertise must be HOST or tcp://HOST:PORT, got {value!r}")
    if not _HOST.match(host) or host in _WILDCARDS:
        raise ValueError(f"fetch_advertise needs a routable host name or address, got {value!r}")


def advertised_fetch_endpoint(bound: str, advertise: str, broker: str) -> str:
    """The fetch address PD workers on other nodes are given.

    A socket bound to a wildcard reports `tcp://0.0.0.0:PORT`, which nobody else can connect to;
    then the address of the interface that routes to the broker is used (found with a UDP
    connect, which sends nothing)."""
    if not bound.startswith("tcp://"):
        return bound  # ipc: same host only, the path is the address
    host, _, port = bound[6:].rpartition(":")
    if advertise.startswith("tcp://"):
        return advertise
    if advertise:
        return f"tcp://{advertise}:{port}"
    if host not in _WILDCARDS:
        return bound
    if not broker.startswith("tcp://"):
        return f"tcp://127.0.0.1:{port}"
    bhost, _, bport = broker[6:].rpartition(":")
    bhost = bhost.strip("[]")
    family = socket.AF_INET6 if ":" in bhost else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((bhost, int(bport) if bport.isdigit() else 9))
            local = s.getsockname()[0]
    except OSError as e:
        raise ValueError(
            f"cannot tell which address to advertise for fetch socket {bound} ({e}); set fetch_advertise"
        ) from None
    return f"tcp://[{local}]:{port}" if ":" in local else f"tcp://{local}:{port}"


def _is_loopback(endpoint: str) -> bool:
    host = endpoint[6:].rpartition(":")[0].strip("[]") if endpoint.startswith("tcp://") else ""
    return host.startswith("127.") or host in ("::1", "localhost")


def default_fetch_bind(security) -> str:
    """tcp on loopback when CURVE keys are at hand; otherwise a private ipc socket (same host)."""
    if security.mode == "curve":
        return "tcp://127.0.0.1:*"
    import tempfile

    d = os.path.join(tempfile.gettempdir(), f"epdq-{os.getuid()}")
    ensure_private_dir(d)
    return f"ipc://{d}/fetch-{os.getpid()}-{uuid.uuid4().hex[:8]}"


async def run_worker(
    cfg: WorkerConfig, *, stop: asyncio.Event | None = None, on_loaded: Callable[[], None] = lambda: None,
    stop_now: asyncio.Event | None = None,
) -> None:  # fmt: skip
    """Serve until `stop` is set or the task is cancelled; `on_loaded` runs once the engine is
    loaded, before the worker registers (the process entry point freezes the heap there).

    Once `stop` is set the worker drains (up to `cfg.drain_timeout_s`): the broker sends it
    nothing new and it finishes what it holds; `stop_now` (Ctrl-C, a second SIGTERM) cuts that short."""
    from epdq.keys import security_for

    security = security_for("worker", keys_dir=cfg.keys_dir, insecure=cfg.insecure)
    model = resolve_model(cfg.model) if cfg.engine != "noop" else "noop"
    stop = stop or asyncio.Event()
    stop_now = stop_now or asyncio.Event()
    if cfg.role == "encoder":
        await _run_encoder(cfg, model, stop, security, on_loaded, stop_now)
    else:
        await _run_pd(cfg, model, stop, security, on_loaded, stop_now)


async def _drain(link: BrokerLink, idle: Callable[[], bool], timeout_s: float, stop_now: asyncio.Event) -> None:
    """Leave gracefully: the broker sends nothing new once it answers our DRAIN; wait until what
    is in hand is done. Ends early (the caller then leaves as before: the broker re-queues what
    had not streamed) on timeout, on `stop_now`, or when the broker is gone."""
    if timeout_s <= 0 or stop_now.is_set() or not link.registered.is_set():
        return
    loop = asyncio.get_running_loop()
    start = loop.time()
    end = start + timeout_s
    # a live broker answers at once; one that does not is gone (its liveness check is slower)
    ack_by = start + min(timeout_s, max(2.0, 2 * link.heartbeat_s))
    link.drain("shutting down")
    log.info("draining: the broker sends nothing new; finishing the work in hand (at most %.0f s; "
             "a second signal stops at once)", timeout_s)  # fmt: skip
    while not (link.drain_acked.is_set() and idle()):
        if stop_now.is_set():
            log.warning("drain cut short: stopping now")
            return
        if loop.time() >= end:
            log.warning("drain timed out after %.0f s with work in hand: leaving anyway", timeout_s)
            return
        if not link.registered.is_set():
            log.warning("the broker went away while draining: leaving")
            return
        if not link.drain_acked.is_set() and loop.time() >= ack_by:
            log.warning("the broker did not answer the drain within %.0f s: leaving", ack_by - start)
            return
        await asyncio.sleep(0.02)
    log.info("drained: nothing in hand")


async def _run_encoder(
    cfg: WorkerConfig, model: str, stop: asyncio.Event, security, on_loaded: Callable[[], None],
    stop_now: asyncio.Event,
) -> None:  # fmt: skip
    import torch

    from epdq.ring import RingWriter, cleanup_stale_segments
    from epdq.worker.encoder import EncoderWorker

    torch.set_num_threads(cfg.threads)
    fetch_bind = cfg.fetch_bind or default_fetch_bind(security)
    removed = cleanup_stale_segments()
    if removed:
        log.info("removed %d shared-memory segments left by dead processes", len(removed))
    _use_device(cfg.device)
    ring_extra: dict = {}
    if cfg.ring == "cuda":
        from epdq.ring_cuda import CudaRingWriter

        # allocated before the model so that it is an allocation of its own (what IPC shares)
        ring = CudaRingWriter(cfg.ring_bytes, device=cfg.device, owner_tag="enc")
        try:
            shared = ring.export()
        except Exception as e:  # noqa: BLE001 - e.g. no CUDA IPC in this container
            log.warning(
                "cannot share the CUDA ring (%s: %s); PD workers will fetch its entries", type(e).__name__, e
            )
            shared = None
        ring_extra = {"ring_kind": "cuda", "cuda_ring": shared}
    try:
        if cfg.engine == "noop":
            from epdq.engines.noop import NoopVisionEngine

            engine = NoopVisionEngine(cost_s=cfg.noop_encode_s)
        else:
            from epdq.engines.vision import HFVisionEncoder

            # embeddings stay on the GPU when the ring is there too
            engine = await _unless_stopped(stop, asyncio.to_thread(
                HFVisionEncoder, model, dtype=cfg.dtype, device=cfg.device,
                output_device=cfg.device if cfg.ring == "cuda" else "cpu",
            ))  # fmt: skip
    except BaseException:
        if ring_extra:
            ring.close()
        raise
    if engine is None:
        if ring_extra:
            ring.close()
        return
    if not ring_extra:
        ring = RingWriter(cfg.ring_bytes, owner_tag="enc")
    worker = EncoderWorker(
        engine, ring, worker_id=cfg.worker_id, node=cfg.node, max_image_bytes=cfg.max_image_bytes,
        max_image_pixels=cfg.max_image_pixels, fetch_bind=fetch_bind, security=security, max_batch=cfg.max_batch,
    )  # fmt: skip
    try:
        fetch = advertised_fetch_endpoint(worker.open_fetch_socket(), cfg.fetch_advertise, cfg.broker)
        worker.fetch_endpoint = fetch
        if _is_loopback(fetch) and cfg.broker.startswith("tcp://") and not _is_loopback(cfg.broker):
            log.warning(
                "fetch socket %s is loopback but the broker is %s: PD workers on other hosts cannot fetch "
                "from this encoder (bind a routable address with --fetch-bind, or set --fetch-advertise)",
                fetch, cfg.broker,
            )  # fmt: skip
        reg = P.Register(
            cfg.worker_id, "encoder", cfg.node, cfg.capacity, engine.scope, os.path.basename(model), os.getpid(),
            ring_segment=ring.name, ring_capacity=ring.capacity, fetch_endpoint=fetch, **ring_extra,
        )  # fmt: skip
        link = BrokerLink(
            cfg.broker, reg, worker.handle, heartbeat_s=cfg.heartbeat_s, on_register_again=worker.abandon,
            heartbeat=worker.heartbeat, security=security, on_refused=lambda _reason: stop.set(),
        )  # fmt: skip
        worker.link = link
        on_loaded()
        worker.start()
        link.start()
        log.info(
            "encoder %s up (ring %s, %d MiB, fetch %s%s)", cfg.worker_id, ring.name, ring.capacity >> 20, fetch,
            f", on {cfg.device}" if cfg.device != "cpu" else "",
        )  # fmt: skip
        loop_task = asyncio.create_task(worker.run())
        try:
            await _until(stop, loop_task)
            await _drain(link, worker.idle, cfg.drain_timeout_s, stop_now)
        finally:
            loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop_task
            link.close()
    finally:
        worker.close()
        ring.close(unlink=True)
    _check_refused(link)


async def _run_pd(
    cfg: WorkerConfig, model: str, stop: asyncio.Event, security, on_loaded: Callable[[], None],
    stop_now: asyncio.Event,
) -> None:  # fmt: skip
    from epdq.worker.pd import PDWorker

    colocated = cfg.role == "both"
    _use_device(cfg.device)
    embed_device = "cpu"  # where the engine takes embeddings: the hf engine on its device
    if cfg.engine == "noop":
        from epdq.engines.noop import NoopPDEngine

        engine = NoopPDEngine(prefill_s=cfg.noop_prefill_s, token_s=cfg.noop_token_s)
    elif cfg.engine == "hf":
        from epdq.engines.hf_pd import HFPDEngine

        engine = await _unless_stopped(stop, asyncio.to_thread(
            HFPDEngine, model, mode="both" if colocated else "pd", dtype=cfg.dtype, device=cfg.device,
            max_model_len=cfg.max_model_len, max_images_per_prompt=cfg.max_images_per_prompt,
        ))  # fmt: skip
        if engine is None:
            return
        embed_device = cfg.device
    else:
        from epdq.engines.vllm_engine import VllmEngine

        _vllm_device(cfg.device)
        dtype = resolve_vllm_dtype(cfg.dtype, cfg.device)
        log.info("vLLM engine in %s (--dtype %s)", dtype, cfg.dtype)
        engine = VllmEngine(
            model, mode="both" if colocated else "pd", dtype=dtype, max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.capacity, kv_cache_bytes=cfg.kv_cache_bytes or None,
            max_images_per_prompt=cfg.max_images_per_prompt,
        )  # fmt: skip
    if not await _unless_stopped(stop, _started(engine)):
        await engine.close()  # a cancelled vLLM start has closed itself: nothing left to do then
        return
    worker = PDWorker(
        engine, worker_id=cfg.worker_id, node=cfg.node, colocated=colocated,
        max_image_bytes=cfg.max_image_bytes, max_image_pixels=cfg.max_image_pixels, security=security,
        device=embed_device,
    )  # fmt: skip
    try:
        reg = P.Register(
            cfg.worker_id, cfg.role, cfg.node, cfg.capacity, "", os.path.basename(model), os.getpid()
        )
        link = BrokerLink(
            cfg.broker, reg, worker.handle, heartbeat_s=cfg.heartbeat_s, on_register_again=worker.abandon,
            heartbeat=worker.heartbeat, security=security, copy=not colocated, on_refused=lambda _reason: stop.set(),
        )  # fmt: skip
        worker.link = link
        on_loaded()
        link.start()
        log.info("%s worker %s up", cfg.role, cfg.worker_id)
        watchdog = asyncio.create_task(_watch_engine(worker))
        try:
            await _until(stop, watchdog)
            if not worker.death:
                await _drain(link, worker.idle, cfg.drain_timeout_s, stop_now)
        finally:
            watchdog.cancel()
            if worker.death:  # BYE first: what was in flight is re-queued, not failed as cancelled
                link.close(f"engine dead: {worker.death}"[:200])
            worker.close()
            link.close()
    finally:
        await engine.close()
    if worker.death:
        raise EngineError(f"the engine died ({worker.death}); this worker left the broker")
    _check_refused(link)


def _check_refused(link: BrokerLink) -> None:
    if link.refused:  # the process exits 2 with this line, and a supervisor sees a setting to fix
        raise ConfigError(f"the broker refused this worker: {link.refused}")


async def _watch_engine(worker, interval_s: float = 0.5) -> None:
    """Until the engine dies (noticed here even when no request is running)."""
    while not worker.check_engine():
        await asyncio.sleep(interval_s)


def _use_device(device: str) -> None:
    """Make a CUDA device this process's current one (streams, IPC mappings and library code that
    asks for 'the' device then agree); nothing on the CPU."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))


def _vllm_device(device: str) -> None:
    """vLLM picks its GPU itself: the engine processes it starts see only the chosen one."""
    if not device.startswith("cuda"):
        return
    index = int(device.split(":")[1])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")] if visible else [str(i) for i in range(index + 1)]
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[index] if index < len(ids) else str(index)
    log.info(
        "vLLM engine on %s (CUDA_VISIBLE_DEVICES=%s for its processes)",
        device,
        os.environ["CUDA_VISIBLE_DEVICES"],
    )


async def _unless_stopped(stop: asyncio.Event, start: Awaitable[T]) -> T | None:
    """Await a start-up step (loading a model: seconds to minutes), unless `stop` comes first (a
    signal while the worker starts): the step is then cancelled and None returned, and the worker
    leaves before it ever registered. A vLLM engine's start ends at once when cancelled; a model
    that loads on a thread of this process (the hf engines) cannot be interrupted, and the process
    exits once that thread is done."""
    task = asyncio.ensure_future(start)
    if not stop.is_set():
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            stopped.cancel()
        if task.done():
            return task.result()
    log.info("told to stop while starting: the model's loading is abandoned, this worker does not register")
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception) as e:  # a start that failed as it was stopped: moot
        log.debug("start-up step ended by the stop: %r", e)
    return None


async def _started(engine) -> bool:
    await engine.start()
    return True


async def _until(stop: asyncio.Event, task: asyncio.Task | None) -> None:
    waiters = [asyncio.create_task(stop.wait())]
    if task is not None:
        waiters.append(task)
    done, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        if t is not task:
            t.cancel()
    for t in done:
        if t is task and t.exception() is not None:
            raise t.exception()
