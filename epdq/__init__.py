"""epdq: encoder-disaggregated serving of vision-language models over an asyncio ZeroMQ pipeline."""

from epdq.client import AsyncClient, Delta, GenerateResult, Timings
from epdq.errors import (
    BrokerUnavailableError,
    BusyError,
    CancelledError,
    DeadlineExceededError,
    EngineError,
    EpdqError,
    InternalError,
    InvalidInputError,
    ProtocolError,
    WorkerLostError,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncClient", "Delta", "GenerateResult", "Timings", "EpdqError", "BusyError", "InvalidInputError",
    "DeadlineExceededError", "WorkerLostError", "BrokerUnavailableError", "CancelledError", "EngineError",
    "ProtocolError", "InternalError", "__version__",
]  # fmt: skip
