"""Logging setup shared by every epdq process: one line per event, text or JSON."""

from __future__ import annotations

import json
import logging
import os
import time

# attributes every LogRecord has; anything else came through `extra=` and is an event field
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():  # request_id, event, ... from `extra=`
            if k not in _STANDARD and k not in out:
                out[k] = v if isinstance(v, str | int | float | bool | type(None)) else str(v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    if fmt not in ("text", "json"):
        raise ValueError("log format must be text or json")
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        f = logging.Formatter(f"%(asctime)s %(levelname)s %(name)s[{os.getpid()}] %(message)s")
        f.converter = time.gmtime
        handler.setFormatter(f)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("epdq").setLevel(level.upper())
