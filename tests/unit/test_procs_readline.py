"""The tests' bounded readline: a line in time is returned, a silent child is killed, not waited for."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.procs import readline


def test_a_line_in_time_is_returned_and_a_silent_child_is_killed():
    talker = subprocess.Popen([sys.executable, "-c", "print('ready', flush=True)"], stdout=subprocess.PIPE, text=True)
    try:
        assert readline(talker, 30).strip() == "ready"
    finally:
        talker.wait(10)
        talker.stdout.close()
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        t0 = time.monotonic()
        with pytest.raises(AssertionError, match=f"no line from pid {silent.pid} within 0.5 s"):
            readline(silent, 0.5)
        assert time.monotonic() - t0 < 10
        assert silent.wait(10) == -9  # killed by the helper
    finally:
        silent.kill()
        silent.wait(10)
        silent.stdout.close()
