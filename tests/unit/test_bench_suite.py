"""`epdq bench all`: the order, arguments and exit codes of the run (the benchmarks themselves faked
here; `tests/integration/test_bench_all.py` runs the real ones at --quick)."""

import pytest

from epdq.benchmarks import suite, summary


@pytest.fixture
def calls(monkeypatch):
    """Every benchmark `main` replaced by a recorder; `codes` sets one's exit code."""
    got: list[tuple[str, list[str]]] = []
    codes: dict[str, int] = {}

    def run_one(name, argv):
        got.append((name, argv))
        return codes.get(name, 0)

    def summary_main(argv, prog):
        got.append(("summary", argv))
        return codes.get("summary", 0)

    monkeypatch.setattr(suite, "run_one", run_one)
    monkeypatch.setattr(summary, "main", summary_main)
    return got, codes


def test_every_benchmark_runs_in_order_into_one_folder_then_the_summary(calls, tmp_path, capsys):
    got, _ = calls
    out = str(tmp_path / "r")
    assert suite.main(["--out", out, "--no-plot"]) == 0
    assert [n for n, _ in got] == ["handoff", "control", "scale", "goodput", "summary"]
    for name, argv in got[:-1]:
        assert argv[-3:] == ["--out", out, "--no-plot"], name
    assert got[0][1][:3] == ["--repeats", "40", "--curve"] and got[1][1][:2] == ["--requests", "8000"]
    assert got[-1][1] == [out]
    printed = capsys.readouterr().out
    assert "=== [1/4] epdq bench handoff --repeats 40 --curve --out" in printed
    assert "=== all 4 benchmarks in" in printed


def test_quick_real_and_check(calls, tmp_path):
    got, codes = calls
    codes["summary"] = 1  # a target missed
    assert suite.main(["--out", str(tmp_path), "--quick", "--real", "--check"]) == 1
    assert [n for n, _ in got] == ["handoff", "control", "scale", "goodput", "goodput", "summary"]
    assert got[3][1][0] == "--quick" and got[4][1][0] == "--real"
    assert got[-1][1] == [str(tmp_path), "--check"]


def test_a_failing_benchmark_stops_the_run_with_its_exit_code(calls, tmp_path, capsys):
    got, codes = calls
    codes["control"] = 130  # Ctrl-C
    assert suite.main(["--out", str(tmp_path)]) == 130
    assert [n for n, _ in got] == ["handoff", "control"]
    assert "epdq bench control exited 130: stopped; the results so far are in" in capsys.readouterr().out


def test_an_unwritable_folder_is_a_usage_error_before_anything_runs(calls, capsys):
    got, _ = calls
    with pytest.raises(SystemExit) as e:
        suite.main(["--out", "/dev/null/r"])
    assert e.value.code == 2 and got == []
    assert "is not a writable directory" in capsys.readouterr().err


def test_a_benchmarks_usage_error_is_its_exit_code():
    # the real scale benchmark's argparse refuses one worker: exit 2, not a SystemExit out of `all`
    assert suite.run_one("scale", ["--workers", "1"]) == 2
