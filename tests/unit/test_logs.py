"""`--log-format json`: one JSON object per line, vLLM's own lines included."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

# what vLLM does with VLLM_LOGGING_CONFIG_PATH at import (dictConfig of the file), then a log line
CHILD = """
import json, logging, logging.config, os, sys
from epdq.logs import setup_logging
setup_logging("info", "json", vllm=True)
path = os.environ.get("VLLM_LOGGING_CONFIG_PATH", "")
print(path, flush=True)
if path.startswith(os.path.join(__import__("tempfile").gettempdir(), "epdq-vllm-logging-")):
    logging.config.dictConfig(json.load(open(path)))
logging.getLogger("vllm.engine").info("engine up %d", 7)
logging.getLogger("epdq.worker").info("worker up")
"""


def run_child(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")} | env_extra
    return subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=30, env=env)


def test_vllm_lines_are_json_objects_and_the_config_file_goes_away():
    r = run_child({})
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    records = [json.loads(line) for line in lines]  # every line is one object
    assert [(x["logger"], x["msg"]) for x in records] == [("vllm.engine", "engine up 7"), ("epdq.worker", "worker up")]
    path = r.stdout.strip()
    assert path and not os.path.exists(path)  # removed at exit


def test_an_operators_own_vllm_logging_settings_win(tmp_path):
    own = tmp_path / "mine.json"
    own.write_text("{}")
    assert run_child({"VLLM_LOGGING_CONFIG_PATH": str(own)}).stdout.strip() == str(own)
    # vLLM refuses a config file when its logging configuration is off: none is set then
    assert run_child({"VLLM_CONFIGURE_LOGGING": "0"}).stdout.strip() == ""


def test_json_lines_carry_no_terminal_colour_copy():
    # uvicorn logs with extra={"color_message": <the message with ANSI codes>}: it went into every JSON line
    import logging

    from epdq.logs import JsonFormatter

    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "Started server process [%d]", (7,), None)
    record.color_message = "Started server process [\x1b[36m%d\x1b[0m]"
    record.event = "started"
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "Started server process [7]" and line["event"] == "started"
    assert "color_message" not in line
