"""Process entry points used by `Cluster` (and so by `epdq up`, `epdq demo` and tests).

`python -m epdq.launch broker '<json BrokerConfig>'`, `... worker '<json WorkerConfig>'` or
`... gateway '<json GatewayConfig>'`. The JSON is decoded strictly into the config dataclass, whose `__post_init__` validates it. SIGTERM
and SIGINT stop the process cleanly (rings unlinked, BYE sent); on SIGTERM a worker first drains
(the broker sends it nothing new and it finishes what it holds, see `run_worker`), and the broker
refuses new requests until those in flight have ended (`Broker.drain`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys

import msgspec

from epdq.errors import ConfigError, EpdqError
from epdq.logs import setup_logging


def freeze_heap() -> None:
    """Move everything alive now (in a worker: torch, transformers, the model, ~170k objects) out
    of the cyclic GC's reach. A full collection over them takes ~70 ms on this machine and would
    land on whichever requests are in flight; what a process loads at start-up lives until exit."""
    gc.collect()
    gc.freeze()


# mallopt(3) parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
KEEP_MAPPED_BELOW = 64 << 20  # allocations smaller than this come from the heap
KEEP_FREE_UP_TO = 256 << 20  # freed heap kept for reuse before any is given back to the kernel


def keep_large_buffers() -> None:
    """Serve large messages (embedding fetches, image files, the tensors they become) from heap
    memory the process keeps, not from fresh mappings.

    By default glibc maps each allocation above a threshold that adapts only up to 32 MiB, and
    gives freed heap back to the kernel past twice that threshold. So every large message (a
    32 MiB fetch answer, or the 4 MiB frames it is sent in) paid a page fault and the kernel's
    zeroing for every 4 KiB, on both sides, every time: 8,192 faults a side at 32 MiB, and remote
    fetches at 1 GB/s (bench/NOTES.md). ZeroMQ's I/O thread allocates the frames it receives with
    the same malloc. The price: up to KEEP_FREE_UP_TO of freed heap stays with the process.
    Where the C library has no mallopt, nothing changes."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt(_M_MMAP_THRESHOLD, KEEP_MAPPED_BELOW)
    mallopt(_M_TRIM_THRESHOLD, KEEP_FREE_UP_TO)


def _install_stop(stop: asyncio.Event, stop_now: asyncio.Event) -> None:
    """SIGTERM sets `stop` (the process then drains); SIGINT, or a second SIGTERM, also sets `stop_now`."""
    loop = asyncio.get_running_loop()

    def on_term() -> None:
        if stop.is_set():
            stop_now.set()
        stop.set()

    def on_int() -> None:
        stop_now.set()
        stop.set()

    loop.add_signal_handler(signal.SIGTERM, on_term)
    loop.add_signal_handler(signal.SIGINT, on_int)


async def serve_broker(cfg) -> None:
    from epdq.broker import Broker
    from epdq.cpus import place_this_process

    place_this_process(cfg.cpus, "broker")  # before the ZeroMQ context: its I/O thread inherits the set
    keep_large_buffers()
    broker = Broker(cfg)
    broker.bind()
    freeze_heap()
    stop, stop_now = asyncio.Event(), asyncio.Event()
    _install_stop(stop, stop_now)
    task = asyncio.create_task(broker.serve())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not task.done():  # SIGTERM: let what is in flight finish (the broker keeps serving meanwhile)
        drain = asyncio.create_task(broker.drain(cfg.drain_timeout_s, stop_now))
        await asyncio.wait((task, drain), return_when=asyncio.FIRST_COMPLETED)
        drain.cancel()
    broker.stop()
    await task  # raises what ended it early (a metrics address in use)


async def serve_worker(cfg) -> None:
    from epdq.cpus import place_this_process
    from epdq.worker.runner import run_worker

    place_this_process(cfg.cpus, f"{cfg.role} worker")  # before the ZeroMQ context and the engine: their threads inherit the set
    keep_large_buffers()
    stop, stop_now = asyncio.Event(), asyncio.Event()
    _install_stop(stop, stop_now)
    await run_worker(cfg, stop=stop, on_loaded=freeze_heap, stop_now=stop_now)


def run(coro) -> None:
    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(coro)
        else:
            uvloop.run(coro)
    finally:
        let_last_messages_leave()


def let_last_messages_leave(timeout_s: float = 1.0) -> None:
    """Terminate the process's ZeroMQ context so that its last messages (the BYEs) leave.

    pyzmq never terminates a context that is left to interpreter exit: its I/O thread dies with
    whatever it still holds, however long the sockets were told to linger. A stuck termination
    (a socket some thread still uses) must not keep the process from ending: bounded."""
    import threading

    import zmq

    from epdq.security import authenticator_for

    ctx = zmq.Context._instance
    if ctx is None or ctx.closed:
        return
    auth = authenticator_for(ctx)
    if auth is not None:
        try:
            auth.stop()  # its thread owns a socket of this context
        except EpdqError:
            return  # a CURVE server socket is still open: leave the context to the exit
    t = threading.Thread(target=ctx.destroy, kwargs={"linger": 200}, name="zmq-term", daemon=True)
    t.start()
    t.join(timeout_s)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3) or argv[0] not in ("broker", "worker", "gateway"):
        print("usage: python -m epdq.launch broker|worker|gateway JSON [LOG_FORMAT]", file=sys.stderr)
        return 2
    log_format = argv[2] if len(argv) == 3 else "text"
    setup_logging("info", log_format, vllm=argv[0] == "worker")
    try:
        _serve(argv[0], argv[1], log_format)
    except EpdqError as e:  # a setting that cannot work here, an engine that died: one line, no traceback
        logging.getLogger("epdq.launch").error("%s stopped: %s (%s)", argv[0], e.message, e.code)
        return 2 if isinstance(e, ConfigError) else 1
    except msgspec.ValidationError as e:  # a config's own checks (__post_init__) refused it
        logging.getLogger("epdq.launch").error("%s stopped: invalid configuration: %s (config)", argv[0], e)
        return 2
    return 0


def _serve(kind: str, config_json: str, log_format: str) -> None:
    if kind == "gateway":
        import dataclasses

        from epdq.gateway import GatewayConfig
        from epdq.gateway import run as run_gateway

        cfg = msgspec.json.decode(config_json, type=GatewayConfig)
        run_gateway(dataclasses.replace(cfg, log_format=log_format))  # uvicorn handles SIGTERM/SIGINT
    elif kind == "broker":
        from epdq.broker import BrokerConfig

        run(serve_broker(msgspec.json.decode(config_json, type=BrokerConfig)))
    else:
        from epdq.worker.runner import WorkerConfig

        run(serve_worker(msgspec.json.decode(config_json, type=WorkerConfig)))


if __name__ == "__main__":
    sys.exit(main())
