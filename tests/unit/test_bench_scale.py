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
    for call in ("submit", "encoded", "first_token", "finished", "tick"):
        assert data["per_call"][call]["n"] > 0
    assert data["memory"]["bytes_per_queued_request"] > 0
    assert "Time per call" in capsys.readouterr().out


def test_scale_runs_when_the_workload_draws_no_image(tmp_path):
    # one request whose draw has no image: the small-index probe used to take its entry class
    # from the (empty) index and stop with StopIteration
    assert scale.main(["--workers", "10", "--requests", "1", "--seed", "1", "--out", str(tmp_path)]) in (0, None)
    assert json.loads((tmp_path / "scale.json").read_text())["completed"] == 1


def test_encoders_and_pd_workers_add_up_to_the_workers_asked_for(tmp_path):
    # 2 workers at an encoder share of 0.9 ran "2 encoders + 1 PD": 3 workers
    assert scale.split_workers(2, 0.9) == (1, 1)
    assert scale.split_workers(2, 0.01) == (1, 1)
    assert scale.split_workers(10, 0.2) == (2, 8)
    res = scale.run(workers=2, requests=5, encoder_share=0.9, nodes=1, memory=False, out_dir=str(tmp_path), seed=3)
    assert (res["workers"]["encoders"], res["workers"]["pds"]) == (1, 1)
    data = json.loads((tmp_path / "scale.json").read_text())
    assert data["seed"] == 3 and data["workers"]["encoder_share"] == 0.9


def test_the_probe_table_says_what_remove_worker_does(tmp_path, capsys):
    # it said "scans the whole index" since the scheduler keeps each encoder's keys (no scan), and
    # printed gauges() as "0.0 ms"
    scale.run(workers=10, requests=200, nodes=5, memory=False, out_dir=str(tmp_path))
    out = capsys.readouterr().out
    why = {c[0]: c[2] for c in ([x.strip() for x in line.split("|")[1:-1]] for line in out.splitlines()
                                if line.startswith("| remove_worker(") or line.startswith("| add+remove"))}  # fmt: skip
    assert why["remove_worker(encoder)"].startswith("drops its own") and "whole index" not in out
    assert "same scan" not in out and why["add+remove_worker(encoder owning none), 1k index"].startswith("no scan")
    gauges = next(line for line in out.splitlines() if line.startswith("| gauges() with"))
    assert "0.0 ms" not in gauges and "µs" in gauges
    assert scale._ms(0.000_69) == "0.69 µs" and scale._ms(0.7876) == "788 µs" and scale._ms(1.23) == "1.2 ms"
