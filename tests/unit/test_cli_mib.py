"""Size options given in MiB (`--max-image-mb`, `--max-held-image-mb`, `--max-body-mb`): a value
that is no finite number of MiB is a usage error naming the flag. `inf` was an OverflowError
traceback (exit 1) from int(inf * 2**20); `nan` named the config field, not the flag."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cli.main import app

pytestmark = pytest.mark.timeout(60)

BROKER = ["broker", "--address", "ipc:///nonexistent-epdq-dir/b.sock"]
GATEWAY = ["serve-http", "--broker", "ipc:///nonexistent-epdq-dir/b.sock", "--port", "1"]


def _run(argv: list[str]):
    if argv[0] == "serve-http":
        pytest.importorskip("fastapi")
    return CliRunner().invoke(app, argv)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e300", "2e6"])
@pytest.mark.parametrize(
    ("command", "flag"),
    [(BROKER, "--max-held-image-mb"), (BROKER, "--max-image-mb"), (GATEWAY, "--max-body-mb"),
     (GATEWAY, "--max-image-mb")],  # fmt: skip
)
def test_a_size_that_is_no_finite_number_of_mib_is_a_usage_error_naming_the_flag(command, flag, value):
    res = _run([*command, flag, value])
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    text = " ".join(res.output.replace("│", " ").split())  # the usage box may wrap the line
    assert f"{flag} must be a number of MiB up to 1048576, got {float(value)}" in text, text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*BROKER, "--max-held-image-mb", "0"], "--max-held-image-mb (in bytes) must be >= 1, got 0"),
        ([*BROKER, "--max-image-mb", "-1"], "--max-image-mb (in bytes) must be in"),
        ([*GATEWAY, "--max-image-mb", "100"], "--max-image-mb (in bytes) must be in"),
    ],
)
def test_a_finite_size_out_of_range_is_still_the_configs_to_refuse(argv, message):
    res = _run(argv)
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.replace("│", " ").split())
