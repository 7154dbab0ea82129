"""The control-plane benchmark runs end to end at a tiny size (no timing assertions)."""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("aiohttp")
pytest.importorskip("matplotlib")

from epdq.benchmarks import control, control_report  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_control_benchmark_small(tmp_path, capsys):
    data = control.run(concurrency=(1, 4), requests=50, out_dir=tmp_path, progress=False)

    out = capsys.readouterr().out
    assert "req/s" in out and "Targets" in out
    saved = json.loads((tmp_path / "control.json").read_text())
    assert saved["benchmark"] == "control"
    png = tmp_path / "control.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    cells = {(r["system"], r["workload"], r["concurrency"]) for r in saved["results"]}
    for c in (1, 4):
        for wl in ("miss", "hit", "text"):
            assert ("epdq", wl, c) in cells
        for system in ("http-vllm", "http-keepalive"):
            for wl in ("image", "image-repeat", "text"):
                assert (system, wl, c) in cells
    assert saved["config"]["rounds"] == 4
    # the credits the cluster ran with, from the workers' own defaults (they move misses at 32)
    assert saved["config"]["epdq_credits"] == {"encoder": 16, "encoder_max_batch": 8, "pd": 16}
    for r in saved["results"]:
        assert r["requests"] == 50 and r["ok"] == 50 and r["errors"] == 0, r
        # 50 requests in 4 rounds (13 + 13 + 12 + 12), each round's throughput on its own
        assert r["rounds"] == 4 and len(r["round_rps"]) == 4 and all(x > 0 for x in r["round_rps"]), r
        assert r["rps"] > 0 and r["p50_ms"] > 0 and r["p99_ms"] >= r["p50_ms"]
        # every process of the system is accounted (CPU times tick at 10 ms: no values asserted)
        roles = {"broker", "encoder", "pd"} if r["system"] == "epdq" else {"proxy", "encoder", "pd"}
        cpu = r["cpu_us_per_request"]
        assert set(cpu) == roles | {"client", "total"}, cpu
        assert all(v >= 0 for v in cpu.values()) and cpu["total"] == pytest.approx(sum(cpu[k] for k in roles | {"client"}))
    assert "CPU per request" in out
    assert len(saved["ratios"]) == 2 * 3 * 2  # 2 concurrencies x 3 epdq workloads x 2 baselines
    assert {x["baseline_workload"] for x in saved["ratios"] if x["workload"] == "hit"} == {"image-repeat"}
    by = {(r["system"], r["workload"], r["concurrency"]): r for r in saved["results"]}
    for x in saved["ratios"]:
        mine = by[("epdq", x["workload"], x["concurrency"])]["round_rps"]
        theirs = by[(x["baseline"], x["baseline_workload"], x["concurrency"])]["round_rps"]
        assert x["throughput_x_rounds"] == pytest.approx([m / t for m, t in zip(mine, theirs, strict=True)])
    assert "rounds: min–max ×" in out
    assert saved["targets"] and data["results"] == saved["results"]
    # hits really skipped the encoder: the broker encoded only the fresh images (warm-up included)
    counters = saved["epdq_broker_counters"]
    assert counters.get("encodes_done", 0) == 2 * 50


def test_fresh_images_stay_distinct_past_the_patterns_period():
    from epdq.demo import demo_image

    # the drawn pattern repeats every 44,800 seeds; the seed stamped into the pixels does not
    assert demo_image(1, (64, 64)) != demo_image(1 + 44_800, (64, 64))
    assert demo_image(0, (64, 64)) != demo_image(44_800, (64, 64))
    assert len({demo_image(s, (2, 1)) for s in range(0, 2**40, 2**32)}) == 256
    with pytest.raises(ValueError):
        demo_image(-1, (8, 8))
    images = control._Images(3)
    assert len(set(images.items)) == 3 and images.hit not in images.items


def test_a_concurrency_given_twice_runs_once(tmp_path):
    # the second run of a level reused the first one's images: its "misses" were all cache hits
    (tmp_path / "control.png").write_bytes(b"an older run's plot")  # --no-plot left it beside the new JSON
    assert control.main(["--requests", "5", "--concurrency", "1", "1", "--no-http", "--no-plot", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "control.json").read_text())
    assert [(r["workload"], r["concurrency"]) for r in saved["results"]] == [("miss", 1), ("hit", 1), ("text", 1)]
    assert not (tmp_path / "control.png").exists()
    assert not saved["targets"] or all("at 1" not in t["target"] or "req/s" not in t["target"] for t in saved["targets"])


def test_making_the_images_yields_to_the_event_loop(monkeypatch):
    # made in one go, 300,000 images kept Ctrl-C (a cancellation of the main task) waiting ~25 s
    import asyncio

    import epdq.demo

    made = []
    real = epdq.demo.demo_image
    monkeypatch.setattr(epdq.demo, "demo_image", lambda seed, size: made.append(seed) or real(seed, (2, 2)))

    async def cancel_early():
        task = asyncio.create_task(control._Images.make(100 * control.IMAGE_CHUNK))
        for _ in range(3):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_early())
    assert 0 < len(made) <= 3 * control.IMAGE_CHUNK
    made.clear()
    images = asyncio.run(control._Images.make(control.IMAGE_CHUNK + 3))
    assert len(set(images.items)) == control.IMAGE_CHUNK + 3 and images.hit not in images.items


def test_rounds_split_the_requests_and_rotate_the_systems():
    assert control._split(50, 4) == [13, 13, 12, 12]
    assert control._split(8000, 4) == [2000] * 4
    assert control._split(3, 3) == [1, 1, 1]
    systems = [("epdq", "miss"), ("http-vllm", "image"), ("http-keepalive", "image")]
    firsts = [control._turns(systems, k)[0] for k in range(3)]
    assert firsts == systems  # each goes first once in three rounds
    assert all(sorted(control._turns(systems, k)) == sorted(systems) for k in range(7))
    cells = control._cells([1, 32], http=True)
    # the hit cell runs the proxy too, on the repeated image: its ratios compare runs of one round
    assert [(c, systems) for c, systems in cells][:3] == [
        (1, [("epdq", "miss"), ("http-vllm", "image"), ("http-keepalive", "image")]),
        (1, [("epdq", "hit"), ("http-vllm", "image-repeat"), ("http-keepalive", "image-repeat")]),
        (1, [("epdq", "text"), ("http-vllm", "text"), ("http-keepalive", "text")]),
    ]
    assert all(len(systems) == 1 for _, systems in control._cells([1], http=False))


@pytest.mark.parametrize("rounds", [0, -1, 6, 1001])
def test_bad_rounds_are_refused_before_anything_runs(tmp_path, rounds, capsys):
    with pytest.raises(ValueError, match="rounds must be"):
        control.run(concurrency=(1,), requests=5, rounds=rounds, out_dir=tmp_path, progress=False)
    with pytest.raises(SystemExit) as e:
        control.main(["--requests", "5", "--rounds", str(rounds), "--out", str(tmp_path)])
    assert e.value.code == 2 and "rounds must be" in capsys.readouterr().err
    assert not (tmp_path / "control.json").exists()


def test_figures_beside_pass_and_miss_follow_their_marks(capsys):
    # a throughput of 4.996x was printed "5.00" and marked MISS against ">= 5x"; a p50 ratio of
    # 0.3334 "0.33", MISS against "<= 0.33"; 9,999.6 req/s "10,000", MISS against ">= 10,000"
    def result(system, workload, rps, p50):
        return {"system": system, "workload": workload, "concurrency": 32, "rps": rps, "p50_ms": p50,
                "p99_ms": 2 * p50, "errors": 0, "round_rps": [rps], "cpu_us_per_request": {}}  # fmt: skip

    results = [result("epdq", "text", 9_999.6, 0.3334), result("http-vllm", "text", 9_999.6 / 4.996, 1.0),
               result("http-keepalive", "text", 9_999.6 / 4.996, 1.0)]  # fmt: skip
    ratios = control_report.ratios_to_proxy(results)
    targets = control_report.targets_judged(results, ratios, [32])
    control_report.print_tables(results, ratios, targets, 8000)
    out = capsys.readouterr().out
    table = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in out.split("Targets")[-1].splitlines() if line.startswith("| ")}  # fmt: skip
    assert table["epdq text req/s at 32"] == ["9,999.6", "≥ 10,000", "MISS"]
    assert table["text throughput vs http-vllm at 32"] == ["4.996", "≥ 5×", "MISS"]
    assert table["text p50 latency vs http-vllm at 32"] == ["0.3334", "≤ ⅓", "MISS"]
    ratio_row = next(line for line in out.splitlines() if "http-vllm/text" in line)
    cells = [c.strip() for c in ratio_row.split("|")[1:-1]]
    assert cells[3] == "4.996" and cells[5] == "0.3334" and cells[7:10] == ["MISS", "MISS", "MISS"]


def test_the_cpu_resolution_counts_a_tick_per_round():
    # each round reads /proc before and after: the error is rounds ticks, not one, over the requests
    import os

    tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
    note = control_report.cpu_resolution_note(2000, 4)
    assert f"~{4 * tick_us / 2000:,.1f} µs per process and request" in note and "4 rounds" in note
    assert f"--requests {int(4 * tick_us / 5):,} or more" in note
    assert control_report.cpu_resolution_note(10**9, 4) == ""


def test_the_workers_run_with_the_credits_given(tmp_path, capsys):
    data = control.run(concurrency=(4,), requests=20, out_dir=tmp_path, progress=False, http=False, plot=False,
                       credits={"encoder": 3, "encoder_max_batch": 2, "pd": 5})  # fmt: skip
    assert data["config"]["epdq_credits"] == {"encoder": 3, "encoder_max_batch": 2, "pd": 5}
    assert data["config"]["credits_set"] == {"encoder": {"capacity": 3, "max_batch": 2}, "pd": {"capacity": 5}}
    assert all(r["ok"] == 20 for r in data["results"])
    # the credits went to the workers, not only into the JSON: the broker has them from REGISTER
    assert data["epdq_workers"] == {"encoder-0": 3, "pd-0": 5}
