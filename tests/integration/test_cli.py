"""The `epdq` command as a user runs it: demo, and up + generate + Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from epdq.demo import demo_image

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

EPDQ = [sys.executable, "-m", "cli.main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_demo_runs_and_matches_colocated():
    addr = f"tcp://127.0.0.1:{free_port()}"
    p = subprocess.run([*EPDQ, "demo", "--address", addr], capture_output=True, text=True, timeout=500)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "cluster ready" in out and "stopping the cluster" in out
    rows = [
        line for line in out.splitlines() if line.startswith(("text only", "one image", "repeated image"))
    ]
    assert len(rows) == 3 and all(" yes " in r for r in rows), out[-4000:]
    assert "1 served from the embedding cache" in out or "served from the embedding cache" in out


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_up_generate_and_ctrl_c_stops_everything(tmp_path):
    addr = f"tcp://127.0.0.1:{free_port()}"
    up = subprocess.Popen(
        [*EPDQ, "up", "--address", addr, "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line, "epdq up exited early:\n" + "".join(lines)
            lines.append(line)
            if "epdq is up" in line:
                break
        else:
            pytest.fail("epdq up did not come up:\n" + "".join(lines))
        children = _children(up.pid)
        assert len(children) == 3  # broker, encoder, pd

        image = tmp_path / "pic.png"
        image.write_bytes(demo_image(5, (112, 112)))
        g = subprocess.run(
            [*EPDQ, "generate", "Describe.", "--image", str(image), "--address", addr, "--json", "--max-tokens", "6"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert g.returncode == 0, g.stderr
        result = json.loads(g.stdout)
        assert len(result["token_ids"]) >= 1 and result["timings"]["route"] == "epd"

        st = subprocess.run([*EPDQ, "status", addr, "--once", "--json"], capture_output=True, text=True, timeout=60)
        assert st.returncode == 0, st.stderr
        status = json.loads(st.stdout)
        assert status["workers_by_role"] == {"encoder": 1, "pd": 1, "both": 0}
        assert status["requests"]["completed"] >= 1 and status["ring"]["capacity_bytes"] > 0
        table = subprocess.run([*EPDQ, "status", addr, "--once"], capture_output=True, text=True, timeout=60)
        assert table.returncode == 0 and "encoder-0" in table.stdout and "hit rate" in table.stdout

        bad = subprocess.run(
            [*EPDQ, "generate", "x", "--image", str(tmp_path), "--address", addr], capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert bad.returncode == 3 and "invalid_input" in bad.stderr

        os.killpg(up.pid, signal.SIGINT)
        rest, _ = up.communicate(timeout=60)
        assert up.returncode == 0, rest
        assert "stopping" in rest
        for pid in children:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)
        up.stdout.close()
