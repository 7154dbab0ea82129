"""The scheduler-at-scale benchmark at a tiny size: JSON keys exist (no timing checks)."""

import json

from epdq.benchmarks import scale


def test_scale_tiny(tmp_path, capsys):
    res = scale.run(workers=50, requests=1000, out_dir=str(tmp_path))
    data = json.loads((tmp_path / "scale.json").read_text())
    for key in (
        "workers",
        "requests",
        "per_call",
        "per_decision_us",
        "probes",
        "memory",
        "seconds",
        "decisions",
    ):
        assert key in data, key
    assert data["completed"] == 1000 == res["completed"]
    assert data["workers"]["encoders"] + data["workers"]["pds"] == 50
    for call in ("submit", "encoded", "first_token", "finished"):
        assert data["per_call"][call]["n"] > 0
    assert data["memory"]["bytes_per_queued_request"] > 0
    assert "Time per call" in capsys.readouterr().out


def test_scale_runs_when_the_workload_draws_no_image(tmp_path):
    # one request whose draw has no image: the small-index probe used to take its entry class
    # from the (empty) index and stop with StopIteration
    assert scale.main(["--workers", "10", "--requests", "1", "--seed", "1", "--out", str(tmp_path)]) in (0, None)
    assert json.loads((tmp_path / "scale.json").read_text())["completed"] == 1
