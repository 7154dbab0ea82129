"""The hand-off benchmark runs end to end at a small size (no timing assertions: machines are noisy)."""

from __future__ import annotations

import json
import os

from epdq.benchmarks import handoff


def test_handoff_benchmark_small(tmp_path, capsys):
    before = set(os.listdir(handoff.SHM_ROOT))
    data = handoff.run(sizes_mib=(1,), repeats=2, out_dir=tmp_path, plot=True)

    saved = json.loads((tmp_path / "handoff.json").read_text())
    assert saved["benchmark"] == "handoff"
    assert saved["results"] == data["results"]
    methods = {r["method"] for r in saved["results"]}
    assert {"memcpy", "ring_view", "ring", "fetch_tcp", "safetensors"} <= methods
    for r in saved["results"]:
        assert r["size_mib"] == 1
        assert r["p50_ms"] > 0 and r["p90_ms"] >= r["p50_ms"]
        assert len(r["samples_ms"]) == 2 and all(v > 0 for v in r["samples_ms"])
        assert all(p["p50_ms"] >= 0 for p in r["parts"].values())
    (target,) = saved["targets"]
    assert target["ring_over_memcpy"] > 0 and target["safetensors_over_ring"] > 0
    assert (tmp_path / "handoff.png").stat().st_size > 0

    printed = capsys.readouterr().out
    assert "ring (view) ÷ memcpy" in printed and ("PASS" in printed or "MISS" in printed)
    # the writer's ring segment and the safetensors directory are gone
    leftovers = set(os.listdir(handoff.SHM_ROOT)) - before
    assert not {n for n in leftovers if n.startswith(("epdq-bench-handoff-", f"epdq-{os.getuid()}-bench-"))}
