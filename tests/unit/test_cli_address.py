"""Client commands name the broker as `epdq worker` does (`--broker`), or as before; `epdq --version`."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cli.main import app

pytestmark = pytest.mark.timeout(30)

NOBODY = "ipc:///nonexistent-epdq-dir/broker.sock"  # nothing listens: the command fails fast, naming it


@pytest.mark.parametrize(
    "argv",
    [
        ["stats", "--broker", NOBODY, "--timeout", "0.3"],
        ["stats", "--address", NOBODY, "--timeout", "0.3"],
        ["stats", NOBODY, "--timeout", "0.3"],
        ["generate", "hi", "--broker", NOBODY, "--timeout", "0.3"],
    ],
)
def test_the_broker_address_is_taken_from_either_spelling(argv):
    res = CliRunner().invoke(app, argv)
    # `epdq`'s entry point turns a typed error that escapes a command into one line (exit 2)
    said = res.output + str(res.exception or "")
    assert res.exit_code != 0 and "No such option" not in said, said
    assert NOBODY in said or "no result within 0.3s" in said, said


@pytest.mark.parametrize("command", ["stats", "status"])
def test_two_different_broker_addresses_are_a_usage_error(command):
    res = CliRunner().invoke(app, [command, "tcp://127.0.0.1:1", "--broker", NOBODY])
    assert res.exit_code == 2
    assert "two broker addresses given" in res.output


@pytest.mark.parametrize("interval", ["0", "nan", "-1"])
def test_status_refuses_a_senseless_interval(interval):
    res = CliRunner().invoke(app, ["status", "--interval", interval])
    assert res.exit_code == 2 and "--interval must be 0.1..3600 seconds" in res.output


def test_version():
    from epdq import __version__
    from epdq.protocol import PROTOCOL_VERSION

    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"epdq {__version__} (wire protocol {PROTOCOL_VERSION})"


@pytest.mark.parametrize(
    "argv, code, said",
    [
        (["generate", "hi", "--broker", NOBODY, "--timeout", "0.3"], 3, "error (deadline)"),
        (["stats", "--broker", NOBODY, "--timeout", "0.3"], 3, "error (broker_unavailable)"),
        (["status", "--broker", NOBODY, "--once"], 3, "error (broker_unavailable)"),
        (["generate", "hi", "--broker", "bogus"], 2, "error (config)"),
        (["generate", "hi", "--broker", NOBODY, "--image", "/nonexistent.png"], 2, "error (invalid_input)"),
        (["generate", "hi", "--timeout", "0"], 2, "timeout"),  # was a ValueError traceback
        (["generate", "hi", "--timeout", "nan"], 2, "timeout"),
        (["generate", "hi", "--broker", NOBODY, "--route", "bogus"], 2, "route must be one of auto, epd, colocated"),
        (["generate", "hi", "--broker", NOBODY, "--route", "colocated", "--stop", "x", "--stop", "y", "--timeout",
          "0.3"], 3, "error (deadline)"),  # fmt: skip  (accepted, then nobody answers)
    ],
)
def test_client_commands_exit_2_for_a_wrong_command_and_3_when_the_cluster_cannot_serve(argv, code, said):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "cli.main", *argv], capture_output=True, text=True, timeout=25)
    assert res.returncode == code, res.stderr
    assert said in res.stderr and "Traceback" not in res.stderr, res.stderr
