"""Logging setup shared by every epdq process: one line per event, text or JSON."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import tempfile
import time

# attributes every LogRecord has; anything else came through `extra=` and is an event field
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
# uvicorn's copy of the message with ANSI colour codes for terminals: no field for a JSON log
_DROPPED = frozenset({"color_message"})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():  # request_id, event, ... from `extra=`
            if k not in _STANDARD and k not in out and k not in _DROPPED:
                out[k] = v if isinstance(v, str | int | float | bool | type(None)) else str(v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(level: str = "info", fmt: str = "text", *, vllm: bool = False) -> None:
    """`vllm`: this process may load vLLM (a worker), whose own logs must follow `fmt` too."""
    if fmt not in ("text", "json"):
        raise ValueError("log format must be text or json")
    if fmt == "json" and vllm:
        _vllm_logs_as_json()
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        f = logging.Formatter(f"%(asctime)s %(levelname)s %(name)s[{os.getpid()}] %(message)s")
        f.converter = time.gmtime
        handler.setFormatter(f)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("epdq").setLevel(level.upper())


def _vllm_logs_as_json() -> None:
    # vLLM configures its own loggers at import (text, one handler, no propagation), here and in
    # its engine process, which inherits the environment: a config file in our format keeps a
    # JSON log one object per line. An operator's own vLLM logging settings win.
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"epdq_json": {"()": f"{__name__}.JsonFormatter"}},
        "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "epdq_json", "level": level,
                              "stream": "ext://sys.stderr"}},
        "loggers": {"vllm": {"handlers": ["vllm"], "level": level, "propagate": False}},
    }  # fmt: skip
    fd, path = tempfile.mkstemp(prefix="epdq-vllm-logging-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = path
    atexit.register(_remove, path)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
