"""The goodput benchmark's cost-model kind at a tiny size: JSON keys and the plot exist (no timing checks)."""

import json
from dataclasses import asdict, replace

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


def _summary(tmp_path, qps: str) -> dict:
    out = tmp_path / qps.replace(",", "_")
    assert goodput.main(["--quick", "--no-plot", "--qps", qps, "--window", "3", "--topologies", "none",
                         "--out", str(out)]) == 0  # fmt: skip
    return json.loads((out / "goodput.json").read_text())


def test_loads_are_swept_in_ascending_order_whatever_order_they_are_given_in(tmp_path, capsys):
    # "--qps 4,2,1" stopped at 4 (or met it and never bisected) and reported a wrong goodput
    ascending, shuffled = _summary(tmp_path, "1,2,4"), _summary(tmp_path, "4,2,1,2")
    assert shuffled["summary"] == ascending["summary"]
    assert shuffled["offered_qps"] == [1.0, 2.0, 4.0]
    high_first = _summary(tmp_path, "20,2")
    assert high_first["summary"]["epd_4img"]["max_qps_meeting_slo"] >= 2.0  # 2 was never offered: 0
    sweep = goodput._Sweep("x", "epd", CostModel(), Workload(output_tokens=3), ttft_slo=100.0, tpot_slo=1.0,
                           window_s=2.0, min_requests=3)  # fmt: skip
    assert sweep.goodput([3.0, 1.0, 2.0], 0)["max_qps_meeting_slo"] == 3.0


def test_real_config_sorts_and_deduplicates_its_loads():
    from epdq.benchmarks.goodput_real import RealConfig

    assert RealConfig(qps=(4.0, 1.0, 2.0, 1.0)).qps == (1.0, 2.0, 4.0)


def test_a_topped_out_grid_is_marked_as_a_lower_bound(tmp_path, capsys):
    data = _summary(tmp_path, "0.5,1")  # every load meets the SLOs: the goodput is only a lower bound
    assert data["summary"]["epd_4img"]["saturated_grid"] is True
    assert all(r["epd_saturated_grid"] and r["colocated_saturated_grid"] for r in data["sensitivity_tpot_slack"])
    assert data["units"]["ttft_*"] == "s" and data["seed"] == 0
    out = capsys.readouterr().out
    assert "≥ 1.00" in out and "unknown (both ≥)" in out and "a lower bound" in out
    assert "EPD / colocated goodput, 4 images per request: 1.00x" not in out


def test_bounded_ratio_text():
    from epdq.benchmarks.goodput_real import bounded_ratio

    assert bounded_ratio(2.0, False, False) == "2.00x"
    assert bounded_ratio(2.0, True, False) == "≥ 2.00x"
    assert bounded_ratio(2.0, False, True) == "≤ 2.00x"
    assert bounded_ratio(2.0, True, True).startswith("unknown")


def test_the_topology_plot_marks_its_bounds_as_the_table_does():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from epdq.benchmarks import goodput_report

    rows = [  # one exact ratio, one over a colocated side that met the SLOs at every load tried
        {"n_pd": 2, "epd_goodput": 6.0, "colocated_goodput": 2.0, "ratio": 3.0},
        {"n_pd": 3, "epd_goodput": 6.0, "colocated_goodput": 4.0, "ratio": 1.5, "colocated_saturated_grid": True},
    ]
    fig, (top, bottom) = plt.subplots(2)
    try:
        goodput_report._plot_ratios(top, bottom, {"topology": rows}, "4 images")
        assert [t.get_text() for t in top.texts] == ["3.00x", "≤ 1.50x"]
    finally:
        plt.close(fig)


def test_print_real_marks_a_saturated_route(capsys):
    from epdq.benchmarks.goodput_real import print_real

    point = {"route": "epd", "offered_qps": 5.0, "completed": 3, "requests": 3, "ttft_p50": 0.1, "ttft_p99": 0.2,
             "tpot_p50": 0.01, "tpot_p99": 0.02, "encode_p50": 0.01, "goodput_rps": 5.0, "meets_slo": True,
             "first_error": None}  # fmt: skip
    res = {"points": [point, point | {"route": "colocated", "offered_qps": 5.0, "meets_slo": False, "goodput_rps": 0.0}],
           "slo": {"ttft_p99_s": 1.0, "tpot_p99_s": 0.05}, "startup_s": 1.0,
           "systems": {"epd": "1 encoder + 1 PD (route epd)", "colocated": "2 colocated (route colocated)"},
           "goodput_rps": {"epd": 5.0, "colocated": 2.0}, "epd_over_colocated": 2.5,
           "saturated_grid": {"epd": True, "colocated": False}}  # fmt: skip
    print_real(res)
    out = capsys.readouterr().out
    assert "EPD ≥ 5.00 req/s" in out and "colocated 2.00 req/s" in out and "≥ 2.50x" in out and "lower bound" in out
    assert "| goodput req/s |" in out  # its goodput column named no unit
    print_real(res | {"slo": {"ttft_p99_s": 1.0, "tpot_p99_s": 0.0004}})  # --tpot-slo 0.0004 read "TPOT <= 0 ms"
    assert "TPOT <= 0.4 ms" in capsys.readouterr().out


@pytest.mark.parametrize("real", [False, True])
def test_no_plot_removes_an_older_plot(tmp_path, real, monkeypatch):
    # the old PNG stayed beside the new JSON and was read as this run's picture
    name = "goodput-real" if real else "goodput"
    (tmp_path / f"{name}.png").write_bytes(b"old")
    if real:
        async def fake_run_real(cfg, log=None):
            return {"kind": "real"}

        monkeypatch.setattr(goodput, "run_real", fake_run_real)
        monkeypatch.setattr(goodput, "print_real", lambda res: None)
        goodput.run(kind="real", out_dir=str(tmp_path), plot=False)
    else:
        goodput.run(kind="cost", out_dir=str(tmp_path), plot=False, qps_grid=[1.0], window_s=2.0, min_requests=3,
                    refine=0, sensitivity=[1.5], topologies=[])  # fmt: skip
    assert (tmp_path / f"{name}.json").exists() and not (tmp_path / f"{name}.png").exists()


def test_a_usage_error_leaves_no_out_directory(tmp_path, capsys):
    out = tmp_path / "new"
    for argv in (["--image-size", "big"], ["--images", "0"], ["--qps", "0.0001"], ["--real", "--pd", "0"]):
        with pytest.raises(SystemExit) as exc:
            goodput.main([*argv, "--out", str(out)])
        assert exc.value.code == 2
        assert not out.exists(), argv


def test_the_repeated_image_scenario_is_labelled_with_its_share(tmp_path, capsys):
    # the table and the plot said "50% repeated images" whatever --repeat-fraction was
    assert goodput.main(["--quick", "--no-plot", "--repeat-fraction", "0.2", "--qps", "1", "--window", "2",
                         "--topologies", "none", "--out", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "EPD, 20% repeated images, cache" in out and "colocated, 20% repeated images" in out
    assert "50%" not in out
    # the load sweeps' TTFT columns (seconds) and goodput (requests/s) named no unit
    sweep_header = next(line for line in out.split("Load sweep")[1].splitlines() if line.startswith("| offered"))
    assert "| goodput req/s |" in sweep_header and "| TTFT p50 s |" in sweep_header and "| TTFT p99 s |" in sweep_header
    data = json.loads((tmp_path / "goodput.json").read_text())
    assert data["workload"]["repeat_workload"]["repeat_fraction"] == 0.2


def test_the_real_kinds_bisection_offers_no_load_twice():
    # loads 1 and 1.01: their geometric mean to 2 decimals is 1.0 again, run a second time
    from epdq.benchmarks.goodput_real import bisect_load

    assert bisect_load(1.0, 1.01) is None and bisect_load(0.01, 0.02) is None
    assert bisect_load(5.0, 10.0) == 7.07 and bisect_load(40.0, 80.0) == 56.57


def test_the_sensitivity_plot_marks_its_bounds_as_the_table_does():
    # its points were drawn as measured ratios where the table said "unknown (both ≥)"
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from epdq.benchmarks import goodput_report

    rows = [
        {"tpot_slo_s": 0.0123, "ratio": 1.76, "epd_goodput": 7.0, "colocated_goodput": 3.97},
        {"tpot_slo_s": 0.0246, "ratio": 1.0, "epd_goodput": 8.0, "colocated_goodput": 8.0,
         "epd_saturated_grid": True, "colocated_saturated_grid": True},
        {"tpot_slo_s": 0.0500, "ratio": float("nan"), "epd_goodput": 0.0, "colocated_goodput": 0.0},
    ]  # fmt: skip
    fig, (top, bottom) = plt.subplots(2)
    try:
        goodput_report._plot_ratios(top, bottom, {"sensitivity_tpot_slack": rows}, "4 images")
        assert [t.get_text() for t in bottom.texts] == ["1.76x", "unknown\n(both ≥)"]
        hollow = [line.get_markerfacecolor() == "none" for line in bottom.lines if line.get_marker() == "o"]
        assert hollow == [False, True]
    finally:
        plt.close(fig)


def test_a_ratio_over_a_side_that_met_no_load_names_that_side():
    # "n/a (no load met the SLOs)" stood beside an EPD goodput of 3.00 (its colocated side: 0)
    import math

    from epdq.benchmarks import goodput_report

    assert goodput_report._x(math.inf) == "n/a (colocated met the SLOs at no offered load)"
    assert goodput_report._xb(math.inf, False, False, "no cache") == "n/a (no cache met the SLOs at no offered load)"
    assert goodput_report._x(math.nan) == goodput_report._x(None) == "n/a (no load met the SLOs)"
    row = {"ratio": math.inf, "epd_goodput": 3.0, "colocated_goodput": 0.0}
    assert goodput_report._ratio_label(row) == "n/a (colocated met the SLOs at no offered load)"


def test_a_load_above_capacity_never_meets_the_slos():
    # 8.0 req/s against 7.978 for one encoder met the SLOs in a 120 s window for one arrival seed
    from epdq.benchmarks.costmodel import capacity_rps

    cm, wl = CostModel(), Workload(output_tokens=3)
    cap = capacity_rps("epd", cm, wl, pds=3)
    per_image = cm.enc_call_s / 8 + cm.enc_image_s + cm.enc_s_per_mpx * 512 * 512 / 1e6
    assert cap == pytest.approx(1 / (4 * per_image))  # the encoder, batching 8 images, is the limit
    assert capacity_rps("epd", cm, replace(wl, repeat_fraction=0.5)) == pytest.approx(2 * cap)
    assert capacity_rps("epd", cm, replace(wl, repeat_fraction=0.5), unique_keys=True) == pytest.approx(cap)
    over = simulate_point("epd", cm, wl, round(cap * 1.05, 3), 6, ttft_slo=1e6, tpot_slo=1e6)
    assert over.completed == 6 and not over.meets_slo and over.capacity_rps == cap  # a short window kept up
    assert simulate_point("epd", cm, wl, round(cap * 0.5, 3), 6, ttft_slo=1e6, tpot_slo=1e6).meets_slo


def test_the_ratio_is_the_median_over_arrival_seeds_and_repeatable(tmp_path, capsys):
    kw = dict(qps_grid=[1.0, 3.0, 6.0, 9.0], window_s=4.0, min_requests=8, refine=1, sensitivity=[1.5],
              topologies=[1], output_tokens=8, seeds=3)  # fmt: skip
    res = goodput.run_cost(**kw)
    for row in res["topology"]:
        assert row["seeds"] == [0, 1, 2] and len(row["ratio_seeds"]) == 3
        assert row["ratio"] == sorted(row["ratio_seeds"])[1] == row["ratio_seeds"][row["median_seed"]]
        assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
    main = next(r for r in res["topology"] if r["n_pd"] == 3)
    assert res["epd_over_colocated_4img"] == main["ratio"] and res["epd_over_colocated_4img_min"] == main["ratio_min"]
    assert res["summary"]["epd_4img"]["goodput_rps"] == main["epd_goodput"]
    assert goodput.run_cost(**kw)["topology"] == res["topology"]  # deterministic for given seeds
    assert goodput.run_cost(**kw | {"seed": 1})["topology"][0]["seeds"] == [1, 2, 3]
    with pytest.raises(ValueError, match="arrival seeds"):
        goodput.run_cost(**kw | {"seeds": 0})
    goodput.print_seeds(res)
    assert "over arrival seeds 0, 1, 2" in capsys.readouterr().out


def test_seeds_is_a_cost_model_option(tmp_path, capsys):
    with pytest.raises(SystemExit):
        goodput.main(["--real", "--seeds", "2", "--out", str(tmp_path / "r")])
    assert "--seeds applies to the cost model only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        goodput.main(["--seeds", "0", "--out", str(tmp_path / "c")])
    assert "arrival seeds must be 1..50" in capsys.readouterr().err


def test_goodput_rps_has_one_definition_in_every_kind():
    # gpu_check divided the within-SLO requests by the wall time, drain included, under the same key
    from epdq.benchmarks import goodput_real, gpu_check

    p = {"offered_qps": 4.0, "requests": 20, "within_slo": 15, "elapsed_s": 9.0}
    assert goodput_real.goodput_rps(p) == 3.0 and gpu_check.goodput_rps is goodput_real.goodput_rps
    assert goodput_real.goodput_rps(p | {"requests": 0, "within_slo": 0}) == 0.0
    cm, wl = CostModel(), Workload(images_per_request=1, output_tokens=3)
    r = simulate_point("epd", cm, wl, 2.0, 10, ttft_slo=1e-9, tpot_slo=1e6)  # none within: 0
    assert r.goodput_rps == goodput_real.goodput_rps(asdict(r)) == 0.0
    r = simulate_point("epd", cm, wl, 2.0, 10, ttft_slo=1e6, tpot_slo=1e6)
    assert r.goodput_rps == goodput_real.goodput_rps({"offered_qps": 2.0, "requests": 10, "within_slo": r.within_slo})
