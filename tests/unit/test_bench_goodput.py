"""The goodput benchmark's cost-model kind at a tiny size: JSON keys and the plot exist (no timing checks)."""

import json

import pytest

from epdq.benchmarks import goodput
from epdq.benchmarks.costmodel import CostModel, Simulation, Workload, make_requests, simulate_point


def test_cost_goodput_tiny(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    res = goodput.run(kind="cost", out_dir=str(tmp_path), qps_grid=[1.0, 40.0], window_s=5.0, min_requests=8,
                      refine=1, sensitivity=[1.5], topologies=[1, 3])  # fmt: skip
    data = json.loads((tmp_path / "goodput.json").read_text())
    assert (tmp_path / "goodput.png").stat().st_size > 0
    for key in ("cost_model", "workload", "slo", "summary", "curves", "epd_over_colocated_4img", "cache_gain",
                "sensitivity_tpot_slack", "method", "environment"):  # fmt: skip
        assert key in data, key
    assert set(data["summary"]) == {"epd_4img", "colocated_4img", "epd_repeat_cache", "epd_repeat_nocache",
                                    "colocated_repeat"}  # fmt: skip
    for curve in data["curves"].values():
        assert {p["offered_qps"] for p in curve} >= {1.0}
        for p in curve:
            for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "goodput_rps", "meets_slo"):
                assert k in p
    assert [r["n_pd"] for r in data["topology"]] == [1, 3]  # N = 3 is the main scenario, not run twice
    assert data["topology"][1]["epd_goodput"] == data["summary"]["epd_4img"]["goodput_rps"]
    assert data["topology"][0]["colocated"] == "2 colocated"
    assert res["kind"] == "cost"
    out = capsys.readouterr().out
    assert "Goodput" in out and "Topology" in out and "Best ratio in this table" in out


@pytest.mark.parametrize("system", ["epd", "colocated"])
def test_simulation_completes_every_request(system):
    cm, wl = CostModel(), Workload(images_per_request=2, output_tokens=5, repeat_fraction=0.5, hot_set=2)
    specs = make_requests(wl, cm, 5.0, 20)
    info = Simulation(system, cm, pds=2, both=3).run(specs)
    assert all(s.done >= s.first >= s.arrival for s in specs)
    assert info["counters"]["requests_completed"] == 20 and info["failed"] == 0
    if system == "epd":  # repeats from a 2-image hot set are encoded once (cache hits or dedup joins)
        assert info["counters"]["encodes_done"] < 40


def test_cache_disabled_encodes_every_image():
    cm, wl = CostModel(), Workload(images_per_request=2, output_tokens=3, repeat_fraction=1.0, hot_set=1)
    r = simulate_point("epd", cm, wl, 2.0, 10, ttft_slo=100, tpot_slo=1, unique_keys=True)
    assert r.extra["counters"]["encodes_done"] == 20 and r.completed == 10


def test_cost_goodput_labels_follow_images_per_request(tmp_path, capsys):
    goodput.run(kind="cost", out_dir=str(tmp_path), plot=False, images_per_request=1, qps_grid=[1.0], window_s=3.0,
                min_requests=4, refine=0, sensitivity=[1.5])  # fmt: skip
    out = capsys.readouterr().out
    assert "1 image/req" in out and "encode 1 image " in out and "1 image per request" in out
    assert "4 img" not in out and "4 images" not in out
    assert json.loads((tmp_path / "goodput.json").read_text())["workload"]["images_per_request"] == 1


def test_no_load_meeting_the_slos_is_written_as_null_not_nan(tmp_path, capsys):
    # NaN is not JSON: strict parsers refused the file; the table said "nanx"
    assert goodput.main(["--quick", "--no-plot", "--out", str(tmp_path), "--ttft-slo", "0.001", "--topologies", "none",
                         "--qps", "5", "--window", "2"]) == 0  # fmt: skip

    def refuse(c):
        raise ValueError(c)

    data = json.loads((tmp_path / "goodput.json").read_text(), parse_constant=refuse)
    assert data["epd_over_colocated_4img"] is None and data["workload"] and data["window_s"] == 2.0  # --window kept
    out = capsys.readouterr().out
    assert "nan" not in out.lower() and "n/a (no load met the SLOs)" in out
