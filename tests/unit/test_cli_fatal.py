"""The line saying why an `epdq` process stopped follows --log-format: with json it was plain text
(`error (config): ...`), so a pipeline that parses the log dropped exactly that line."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import epdq.launch as launch
from cli.main import app
from epdq.errors import EngineError

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]


def _broker_without_keys(tmp_path: Path, *log_format: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, EPDQ_HOME=str(tmp_path / "home"))
    argv = ["broker", "--address", "tcp://127.0.0.1:1", "--keys-dir", str(tmp_path / "nokeys"), *log_format]
    return subprocess.run([sys.executable, "-m", "cli.main", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=50)  # fmt: skip


def test_with_json_logs_the_fatal_line_is_a_json_object(tmp_path):
    res = _broker_without_keys(tmp_path, "--log-format", "json")
    assert res.returncode == 2, res.stderr
    lines = [json.loads(line) for line in res.stderr.splitlines()]  # every line, not only the last
    fatal = lines[-1]
    assert fatal["level"] == "error" and fatal["event"] == "fatal" and fatal["code"] == "config"
    assert f"{tmp_path}/nokeys has no broker.key_secret" in fatal["msg"]
    assert {"ts", "logger", "pid"} <= set(fatal)


def test_with_text_logs_it_stays_one_plain_line(tmp_path):
    res = _broker_without_keys(tmp_path)
    assert res.returncode == 2
    assert res.stderr.splitlines()[-1].startswith(f"error (config): {tmp_path}/nokeys has no broker.key_secret")


@pytest.fixture
def root_logging(monkeypatch):
    # `epdq worker` sets the process's logging up; put pytest's back afterwards
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")  # no vLLM logging config file for this process
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_a_worker_whose_engine_died_says_so_in_json(monkeypatch, tmp_path, root_logging):
    async def engine_dies(cfg):
        raise EngineError("the engine died (EngineCore gone); this worker left the broker")

    monkeypatch.setattr(launch, "serve_worker", engine_dies)
    argv = ["worker", "--role", "pd", "--engine", "noop", "--broker", f"ipc://{tmp_path}/b", "--log-format", "json"]
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 1, res.output
    fatal = json.loads(res.output.splitlines()[-1])
    assert (fatal["event"], fatal["code"]) == ("fatal", "engine") and fatal["msg"].startswith("the engine died")


@pytest.mark.parametrize(
    ("argv", "msg"),
    [(["broker", "--log-format", "json", "--max-queued", "0"], "Invalid value: --max-queued must be >= 1, got 0"),
     (["broker", "--log-format=json", "--bogus"], "No such option: --bogus"),
     (["up", "--cpus", "gpu=0", "--log-format", "json"], "--cpus: 'gpu' is not a role to place")],
)  # fmt: skip
def test_with_json_logs_a_usage_error_is_a_json_object_too(argv, msg):
    # it was typer's text box: the one line of such a run that a JSON log pipeline dropped
    res = subprocess.run([sys.executable, "-m", "cli.main", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=50)  # fmt: skip
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.splitlines()
    err = json.loads(line)
    assert err["level"] == "error" and err["event"] == "usage" and err["code"] == "usage"
    assert msg in err["msg"], err
    assert err["command"].endswith(f" {argv[0]}"), err


def test_with_json_logs_help_and_plain_exits_are_untouched():
    res = subprocess.run([sys.executable, "-m", "cli.main", "worker", "--log-format", "json", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=50)  # fmt: skip
    assert res.returncode == 0 and "Usage:" in res.stdout and res.stderr == ""
    text = subprocess.run([sys.executable, "-m", "cli.main", "broker", "--max-queued", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=50)  # fmt: skip
    assert text.returncode == 2 and "Invalid value" in text.stderr and not text.stderr.lstrip().startswith("{")
