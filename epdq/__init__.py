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
