"""Typed errors a client, worker or broker can see.

Every error that crosses the wire carries a short `code` (see `ErrorCode` in the protocol) so the
receiving side can rebuild the same exception type. `retryable` tells a caller whether sending the
same request again may succeed.
"""

from __future__ import annotations


class EpdqError(Exception):
    """Base class of every error epdq raises on purpose."""

    code = "internal"
    retryable = False

    def __init__(self, message: str = "", *, request_id: str | None = None):
        super().__init__(message or self.__class__.__doc__ or self.code)
        self.message = message or (self.__class__.__doc__ or self.code).strip()
        self.request_id = request_id


class BusyError(EpdqError):
    """The system is at capacity; retry after `retry_after` seconds."""

    code = "busy"
    retryable = True

    def __init__(self, message: str = "", *, retry_after: float = 1.0, request_id: str | None = None):
        super().__init__(message, request_id=request_id)
        self.retry_after = retry_after


class InvalidInputError(EpdqError):
    """The request is malformed or violates a limit (bad image, too many images, bad parameters)."""

    code = "invalid_input"


class DeadlineExceededError(EpdqError):
    """The request did not finish before its deadline."""

    code = "deadline"
    retryable = True


class WorkerLostError(EpdqError):
    """A worker died while it held this request and the work could not be retried."""

    code = "worker_lost"
    retryable = True


class BrokerUnavailableError(EpdqError):
    """The broker cannot be reached or stopped answering."""

    code = "broker_unavailable"
    retryable = True


class CancelledError(EpdqError):
    """The request was cancelled."""

    code = "cancelled"


class EngineError(EpdqError):
    """The inference engine failed while running this request."""

    code = "engine"


class ProtocolError(EpdqError):
    """A message did not match the wire protocol (bad frame count, schema or size)."""

    code = "protocol"


class StaleEmbeddingError(EpdqError):
    """An embedding-ring entry was overwritten before it was read; the broker re-encodes it."""

    code = "stale"
    retryable = True


class EntryPending(StaleEmbeddingError):
    """A ring entry is announced but its bytes are still being copied in (`RingWriter.reserve`).
    A StaleEmbeddingError, so a caller that does not wait (`RingReader.wait_published`) takes it
    as gone and has the image encoded again: never wrong, only slower."""


class FetchFailedError(StaleEmbeddingError):
    """A PD worker could not fetch an embedding from an encoder on another node (no answer, or the
    link refused): the broker re-encodes it a few times (it may land on a reachable encoder), then
    fails the request as `WorkerLostError` naming the endpoint."""

    code = "fetch_failed"


class RingFullError(InvalidInputError):
    """An image's embedding is larger than the encoders' ring: a smaller image, or encoders with a
    larger --ring-mb (an InvalidInputError: the same request fails the same way again)."""

    code = "ring_full"


class ConfigError(EpdqError):
    """A setting this process was started with cannot work here (an address already in use, a
    model directory that is not a checkpoint)."""

    code = "config"


class InternalError(EpdqError):
    """An unexpected failure inside epdq (a bug); the message says where."""

    code = "internal"


_BY_CODE: dict[str, type[EpdqError]] = {
    cls.code: cls
    for cls in (
        BusyError,
        InvalidInputError,
        DeadlineExceededError,
        WorkerLostError,
        BrokerUnavailableError,
        CancelledError,
        EngineError,
        ProtocolError,
        StaleEmbeddingError,
        FetchFailedError,
        RingFullError,
        ConfigError,
        InternalError,
    )
}


def error_from_code(
    code: str, message: str, *, request_id: str | None = None, retry_after: float = 0.0
) -> EpdqError:
    """Rebuild the typed exception for an error received over the wire."""
    cls = _BY_CODE.get(code, InternalError)
    if cls is BusyError:
        return BusyError(message, retry_after=retry_after, request_id=request_id)
    return cls(message, request_id=request_id)
