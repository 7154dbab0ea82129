"""epdq: encoder-disaggregated serving of vision-language models over an asyncio ZeroMQ pipeline."""

from epdq.errors import (
    BrokerUnavailableError,
    BusyError,
    CancelledError,
    ConfigError,
    DeadlineExceededError,
    EngineError,
    EpdqError,
    InternalError,
    InvalidInputError,
    ProtocolError,
    RingFullError,
    WorkerLostError,
)

__version__ = "0.1.0"


def _watch_parent_early() -> None:
    """A child that multiprocessing spawns (vLLM's EngineCore) imports its parent's main module
    (`epdq.launch`, or the `epdq` script's `cli.main`), and so this package, before any of vLLM's
    code. vLLM loads epdq's plugin, whose thread ends the child with its worker, only after the
    child's handshake with that worker, which a SIGKILLed worker never answers: the core waited
    5 minutes. Starting the thread here covers that window. Only in children of a worker that
    asked for it (EPDQ_DIE_WITH_PARENT=1); elsewhere this costs one environment lookup."""
    import os

    if os.environ.get("EPDQ_DIE_WITH_PARENT") != "1":
        return
    import multiprocessing

    # `_inheriting` is multiprocessing's own mark of a child being prepared (its spawn module
    # checks it the same way); parent_process() is only set after the preparation
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        from epdq.engines.vllm_plugin import watch_parent

        watch_parent(preparing=True)


_watch_parent_early()

_CLIENT_NAMES = ("AsyncClient", "Delta", "GenerateResult", "Timings")


def __getattr__(name: str):
    # lazy, so `import epdq.scheduler` (pure logic) does not drag in zmq through the client
    if name in _CLIENT_NAMES:
        from epdq import client

        return getattr(client, name)
    raise AttributeError(f"module 'epdq' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_CLIENT_NAMES))


__all__ = [
    *_CLIENT_NAMES, "EpdqError", "BusyError", "InvalidInputError", "DeadlineExceededError", "WorkerLostError",
    "BrokerUnavailableError", "CancelledError", "EngineError", "ProtocolError", "ConfigError", "InternalError",
    "RingFullError",
    "__version__",
]  # fmt: skip
