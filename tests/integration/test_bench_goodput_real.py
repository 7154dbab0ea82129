"""The goodput benchmark's real kind at a tiny size: 1 encoder + 1 PD and 2 colocated workers of
the tiny model in one cluster, one offered load, a few requests per system (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from epdq.benchmarks import goodput
from epdq.benchmarks.goodput_real import RealConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


def test_real_goodput_runs_both_systems(tmp_path, model_dir, capsys):
    cfg = RealConfig(qps=(2.0,), window_s=1.5, images_per_request=1, image_size=(56, 56), max_tokens=3,
                     model=model_dir, ttft_slo_s=60.0, tpot_slo_s=10.0)  # fmt: skip
    res = goodput.run(kind="real", out_dir=str(tmp_path), plot=False, real=cfg)
    assert res["systems"] == {"epd": "1 encoder + 1 PD (route epd)", "colocated": "2 colocated (route colocated)"}
    assert [(p["route"], p["completed"], p["errors"]) for p in res["points"]] == [("epd", 3, 0), ("colocated", 3, 0)]
    # SLOs this loose are met by both: goodput is then the offered load's within-SLO rate
    assert res["goodput_rps"] == {"epd": 2.0, "colocated": 2.0} and res["epd_over_colocated"] == 1.0
    assert res["counters"]["encodes_done"] >= 3  # the epd route's images went through the encoder
    written = json.loads((tmp_path / "goodput-real.json").read_text())
    assert written["benchmark"] == "goodput" and written["goodput_rps"] == res["goodput_rps"]
    out = capsys.readouterr().out
    assert "Real tiny model on CPU (1 encoder + 1 PD vs 2 colocated" in out
    # one load, met by both: each goodput is only a lower bound, and the tables say so
    assert res["saturated_grid"] == {"epd": True, "colocated": True}
    assert "EPD ≥ 2.00 req/s, colocated ≥ 2.00 req/s, EPD / colocated unknown (both ≥)" in out
