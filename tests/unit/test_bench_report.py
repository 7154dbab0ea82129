"""The benchmarks' shared output helpers: the progress bar, figures beside PASS/MISS marks, and SIGTERM
unwinding a run (its children stopped, its temporary directories removed)."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epdq.benchmarks import report
from epdq.benchmarks.report import Progress
from tests.procs import alive

ROOT = Path(__file__).resolve().parents[2]


def test_the_progress_line_is_finished_once_and_never_counts_past_its_end():
    # the goodput bar counted on to "71/55" and drew a fresh line for every load point past its end
    out = io.StringIO()
    bar = Progress(3, "x", force=True, stream=out)
    for _ in range(6):
        bar.advance()
    bar.advance(0)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("3/3 eta   0.0s\n")
    assert "4/3" not in text and "6/3" not in text


def test_the_goodput_bar_ends_where_its_count_ends(monkeypatch):
    from epdq.benchmarks import goodput

    out = io.StringIO()
    bars: list[Progress] = []
    monkeypatch.setattr(goodput, "Progress",
                        lambda total, label: bars.append(Progress(total, label, force=True, stream=out)) or bars[-1])
    grid = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]  # the EPD sweeps pass most of it, then bisect
    goodput.run_cost(qps_grid=grid, window_s=10.0, min_requests=20, refine=2, sensitivity=[1.5, 3.0], topologies=[1])
    (bar,) = bars
    # the 3 repeated-image sweeps, 2 slacks x 2 systems, and N = 1 and the main N = 3 x 2 systems x 3 arrival seeds
    sweeps = 3 + 2 * 2 + 2 * 2 * goodput.DEFAULT_SEEDS
    assert bar.total == sweeps * (len(grid) + 2) and bar.done == bar.total
    text = out.getvalue()
    counts = [int(part.split("] ")[1].split("/")[0]) for part in text.split("\r") if "] " in part]
    assert text.count("\n") == 1 and max(counts) <= bar.total  # it counted to "71/55", a line per point past 55


@pytest.mark.parametrize(
    ("value", "target", "at_most", "digits", "text"),
    [
        (1.3018, 1.3, True, 2, "1.302"),  # was "1.30×  ≤ 1.3×  MISS"
        (1.2999, 1.3, True, 2, "1.30"),  # "1.30 ≤ 1.3": PASS follows
        (1.0642, 1.3, True, 2, "1.06"),
        (4.96, 5.0, False, 1, "4.96"),  # was "5.0×  ≥ 5×  MISS"
        (4.996, 5.0, False, None, "4.996"),
        (0.3334, 1 / 3, True, None, "0.3334"),  # was "0.33" against "≤⅓", MISS
        (0.3331, 1 / 3, True, None, "0.33"),
        (9_999.6, 10_000.0, False, None, "9,999.6"),  # was "10,000" against "≥ 10,000", MISS
        (12_500.0, 10_000.0, False, None, "12,500"),
        (float("nan"), 5.0, False, None, "n/a"),
    ],
)
def test_a_figure_beside_a_mark_is_printed_on_the_side_of_its_target(value, target, at_most, digits, text):
    assert report.vs_target(value, target, at_most=at_most, digits=digits) == text


# SIGTERM in the middle of a run. Run in a child interpreter: without the handler, SIGTERM ends the
# process on the spot (it would end pytest itself). The child prints each temporary directory the
# run makes, as it makes it; the parent checks that none is left and that the child exits 143.
_CHILD = r"""
import os, signal, sys, tempfile
real_mkdtemp = tempfile.mkdtemp
def mkdtemp(*a, **k):
    path = real_mkdtemp(*a, **k)
    print("DIR", path, flush=True)
    return path
tempfile.mkdtemp = mkdtemp
kind, out = sys.argv[1], sys.argv[2]

def terminate():
    signal.raise_signal(signal.SIGTERM)
    for _ in range(100):  # the handler runs at once; bounded in case it does not
        import time; time.sleep(0.05)

if kind == "handoff":
    from epdq.benchmarks import handoff, handoff_common
    real_lines = handoff_common._lines
    def lines(proc, timeout_s):
        for item in real_lines(proc, timeout_s):
            yield item
            if item[0] == "SEG":  # both children up, the ring made: SIGTERM now
                me = os.getpid()
                with open(f"/proc/{me}/task/{me}/children") as f:
                    print("PIDS", f.read(), flush=True)
                terminate()
    handoff_common._lines = lines
    rc = handoff.main(["--sizes", "0.01", "--repeats", "1", "--warmup", "0", "--pool-mib", "4", "--ring-mib", "4",
                       "--curve", "--no-cuda", "--no-plot", "--out", out])
elif kind == "control":
    from epdq.benchmarks import control
    real_phase = control._EpdqSystem.phase
    async def phase(self, *a, **k):
        print("PIDS", " ".join(str(p) for r, p in self.pids().items() if r != "client"), flush=True)
        terminate()
        return await real_phase(self, *a, **k)
    control._EpdqSystem.phase = phase
    rc = control.main(["--requests", "2", "--warmup", "0", "--concurrency", "1", "--no-http", "--no-plot",
                       "--out", out])
else:  # goodput: its run stands in for the real kind's (a cluster in a temporary directory)
    from epdq.benchmarks import goodput
    def run(**_kw):
        with tempfile.TemporaryDirectory(prefix="epdq-goodput-") as d:
            print("DIR", d, flush=True)
            terminate()
    goodput.run = run
    rc = goodput.main(["--quick", "--out", out])
print("RETURNED", rc, flush=True)
"""


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["handoff", "control", "goodput"])
def test_sigterm_stops_the_children_and_removes_the_temporary_directories(tmp_path, kind):
    # SIGTERM (kill, timeout, a service manager) ended the run at once: /tmp/epdq-bench-control-*,
    # /dev/shm/epdq-bench-handoff-* and /tmp/epdq-bench-keys-* (CURVE secret keys) stayed behind,
    # and goodput --real's workers, still loading the model, outlived it
    if kind == "control":
        for mod in ("fastapi", "uvicorn", "aiohttp"):
            pytest.importorskip(mod)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", _CHILD, kind, str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=150, env=env, stdin=subprocess.DEVNULL)  # fmt: skip
    lines = proc.stdout.splitlines()
    dirs = [line.split(" ", 1)[1] for line in lines if line.startswith("DIR ")]
    pids = [int(p) for line in lines if line.startswith("PIDS ") for p in line.split()[1:]]
    try:
        assert dirs, proc.stdout + proc.stderr
        assert proc.returncode == 143, (proc.returncode, proc.stdout, proc.stderr[-3000:])
        assert "RETURNED" not in proc.stdout and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert [d for d in dirs if os.path.exists(d)] == []
        if kind != "goodput":
            assert pids
            deadline = time.monotonic() + 10  # orphans would be the old behaviour's children, dying slowly
            while any(alive(p) for p in pids) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert [p for p in pids if alive(p)] == []
        assert not (tmp_path / "out" / f"{kind}.json").exists()
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def test_sigterm_unwinds_only_while_it_is_in_force():
    before = signal.getsignal(signal.SIGTERM)
    cleaned = []
    with pytest.raises(SystemExit) as exc:
        with report.sigterm_unwinds():
            try:
                signal.raise_signal(signal.SIGTERM)
                for _ in range(100):
                    time.sleep(0.01)
            finally:
                cleaned.append(True)
    assert exc.value.code == 143 and cleaned == [True]
    assert signal.getsignal(signal.SIGTERM) == before


def test_an_out_that_is_a_file_is_called_a_file(tmp_path):
    # the reason read "File exists" (for a file in the way) and "Not a directory"
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="^--out '.*a-file' is not a writable directory: it is a file$"):
        report.check_out_dir(blocker)
    with pytest.raises(ValueError, match="is not a writable directory: a part of the path is a file$"):
        report.check_out_dir(blocker / "results")


def test_the_idle_policy_is_read_from_sysfs_and_anything_odd_is_none(tmp_path):
    cpuidle = tmp_path / "cpuidle"
    cpuidle.mkdir()
    (cpuidle / "current_driver").write_text("haltpoll\n")
    (cpuidle / "current_governor_ro").write_text("menu\n")  # older kernels: read-only name only
    poll = tmp_path / "guest_halt_poll_ns"
    poll.write_text("200000\n")
    assert report.idle_policy(str(cpuidle), str(poll)) == {
        "driver": "haltpoll", "governor": "menu", "halt_poll_ns": 200000,
    }  # fmt: skip
    (cpuidle / "current_driver").write_text("x" * 100)  # not a driver's name
    poll.write_text("-1\n")
    assert report.idle_policy(str(cpuidle), str(poll)) == {"driver": None, "governor": "menu", "halt_poll_ns": None}
    missing = str(tmp_path / "none")
    assert report.idle_policy(missing, missing) == {"driver": None, "governor": None, "halt_poll_ns": None}
    # every result's environment carries it
    assert set(report.environment()["idle"]) == {"driver", "governor", "halt_poll_ns"}
