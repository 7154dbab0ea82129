"""`epdq bench summary`: every benchmark's targets in one table, read from the runs' JSON files."""

import json
import re
import shutil
from pathlib import Path

import pytest

from epdq.benchmarks import scale, summary

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _rows(capsys) -> dict[str, list[str]]:
    """target -> the cells of its row in the printed table."""
    out = capsys.readouterr().out
    cells = ([c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| "))
    return {c[1]: c for c in cells if c[0] != "benchmark"}


def _control(ok_hits: bool) -> dict:
    t = [
        {"target": "epdq hit req/s at 32", "value": 11000.0 if ok_hits else 9000.0, "limit": 10000.0,
         "at_most": False, "goal": "≥ 10,000", "pass": ok_hits},
        {"target": "hit p50 latency vs http-vllm at 1", "value": 0.25, "limit": 1 / 3, "at_most": True,
         "goal": "≤ ⅓", "pass": True},
        {"target": "hit throughput vs http-vllm at 32", "value": None, "limit": 5.0, "at_most": False,
         "goal": "≥ 5×", "pass": False},
    ]  # fmt: skip
    env = {"time_utc": "2026-12-03T14:06:06Z", "speed": {"python_loop_ns": 26.3, "memcpy_gb_s": 6.88}}
    return {"benchmark": "control", "environment": env, "targets": t}


def test_the_committed_results_of_every_benchmark_are_read(tmp_path, capsys):
    # the files README's tables come from: real outputs of each benchmark (format drift shows here)
    assert summary.main([str(RESULTS)]) == 0
    rows = _rows(capsys)
    assert rows["ring (view) ÷ one memcpy, 32 MiB"][2] == "≤ 1.3×"
    assert rows["safetensors path ÷ ring, to the tensor in hand, 8 MiB"][4] in ("PASS", "MISS")
    assert rows["the same, both ending in a copy, 8 MiB"][4] in ("PASS", "MISS")
    assert rows["epdq miss req/s at 32"][3].endswith(" req/s")
    assert rows["EPD ÷ colocated goodput, 4 images, cost model: 1E+3PD vs 4 (median of 3 arrival seeds)"][2] == "≥ 2×"
    assert rows["the same, best N of the topology table: 1E+2PD vs 3"][2:5:2] == ["shown", "shown"]
    assert rows["cache gain, repeated images"][4] == "shown"
    assert "real tiny model" in next(t for t in rows if t.startswith("EPD ÷ colocated goodput, real"))
    assert any(t.startswith("time per dispatch decision") for t in rows)
    assert summary.main([str(RESULTS), "--json", str(tmp_path / "s.json")]) == 0
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["benchmark"] == "summary" and data["missing"] == [] and 0 < data["met"] <= data["judged"]
    assert {r["result"] for r in data["rows"]} <= {"PASS", "MISS", "shown"}


def test_a_fresh_run_is_read_and_the_benchmarks_not_run_are_named(tmp_path, capsys):
    scale.run(workers=10, requests=50, nodes=2, memory=False, out_dir=str(tmp_path))
    capsys.readouterr()
    assert summary.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "encode " in out and " µs, prefill " in out and "0 of 0 judged targets met" in out
    for name in ("handoff.json", "control.json", "goodput.json", "goodput-real.json"):
        assert f"not run: {name} (`epdq bench " in out and f"--out {tmp_path}`" in out


def test_check_exits_1_only_when_a_judged_target_is_missed(tmp_path, capsys):
    (tmp_path / "control.json").write_text(json.dumps(_control(ok_hits=True)))
    assert summary.main([str(tmp_path), "--check"]) == 1  # a ratio the run could not measure is a miss
    rows = _rows(capsys)
    assert rows["hit throughput vs http-vllm at 32"][3:5] == ["n/a", "MISS"]
    assert rows["epdq hit req/s at 32"][3:6] == ["11,000 req/s", "PASS", "2026-12-03 14:06 (loop 26 ns, memcpy 6.9 GB/s)"]
    assert rows["hit p50 latency vs http-vllm at 1"][3] == "0.25"
    data = _control(ok_hits=True)
    data["targets"] = data["targets"][:2]
    data["environment"] = {"time_utc": 7, "speed": {"memcpy_gb_s": "fast"}}  # what it cannot read: left out
    (tmp_path / "control.json").write_text(json.dumps(data))
    assert summary.main([str(tmp_path), "--check"]) == 0
    assert summary.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 of 2 judged targets met" in out and "| PASS   | ?" in out
    (tmp_path / "control.json").write_text(json.dumps(_control(ok_hits=False)))
    assert summary.main([str(tmp_path)]) == 0  # without --check a miss is reported, not an error


def test_a_judged_figure_is_printed_on_the_side_of_its_target_that_its_mark_says(tmp_path, capsys):
    # values from README's runs, printed "1.30× MISS" and "0.33 MISS" with fixed decimals
    h = json.loads((RESULTS / "handoff.json").read_text())
    h["targets"][0].update(ring_over_memcpy=1.302, ring_pass=False, safetensors_over_ring=4.96, safetensors_pass=False,
                           safetensors_copy_over_ring_copy=4.996, safetensors_copy_pass=False)
    (tmp_path / "handoff.json").write_text(json.dumps(h))
    data = _control(ok_hits=False)
    data["targets"][0]["value"] = 9999.7  # "10,000 req/s MISS" with 0 decimals
    data["targets"][1].update({"value": 0.334, "pass": False})
    (tmp_path / "control.json").write_text(json.dumps(data))
    assert summary.main([str(tmp_path)]) == 0
    rows = _rows(capsys)
    size = f"{float(h['targets'][0]['size_mib']):g} MiB"
    assert rows[f"ring (view) ÷ one memcpy, {size}"][3:5] == ["1.302×", "MISS"]
    assert rows[f"safetensors path ÷ ring, to the tensor in hand, {size}"][3:5] == ["4.96×", "MISS"]
    assert rows[f"the same, both ending in a copy, {size}"][3:5] == ["4.996×", "MISS"]
    assert rows["epdq hit req/s at 32"][3:5] == ["9,999.7 req/s", "MISS"]
    assert rows["hit p50 latency vs http-vllm at 1"][3:5] == ["0.334", "MISS"]


def _goodput(main: tuple[float, bool, bool], best: float) -> dict:
    def row(n: int, ratio: float, lo: bool = False, hi: bool = False) -> dict:
        return {"n_pd": n, "epd": f"1 encoder + {n} PD", "colocated": f"{n + 1} colocated", "ratio": ratio,
                "epd_saturated_grid": lo, "colocated_saturated_grid": hi, "ratio_min": ratio - 0.3,
                "ratio_max": ratio + 0.1, "ratio_seeds": [ratio - 0.3, ratio, ratio + 0.1]}  # fmt: skip

    return {"benchmark": "goodput", "kind": "cost", "systems": {"epd": "1 encoder + 3 PD", "colocated": "4 colocated"},
            "workload": {"images_per_request": 4}, "seeds": [0, 1, 2], "cache_gain": 1.5,
            "topology": [row(2, best), row(3, *main)], "environment": {}}  # fmt: skip


@pytest.mark.parametrize(
    ("main", "figure", "result"),
    [
        ((1.88, False, False), "1.88× (seeds 1.58–1.98×)", "MISS"),  # a better N elsewhere does not make it pass
        ((2.1, False, False), "2.10× (seeds 1.80–2.20×)", "PASS"),
        ((2.1, True, False), "≥ 2.10× (seeds 1.80–2.20×)", "PASS"),  # a lower bound above the target decides
        ((1.9, True, False), "≥ 1.90× (seeds 1.60–2.00×)", "MISS"),  # it cannot tell: not a pass
        ((2.5, False, True), "≤ 2.50× (seeds 2.20–2.60×)", "MISS"),
    ],
)
def test_goodput_is_judged_at_the_runs_own_topology_and_bounds_are_marked(tmp_path, capsys, main, figure, result):
    (tmp_path / "goodput.json").write_text(json.dumps(_goodput(main, best=2.72)))
    assert summary.main([str(tmp_path)]) == 0
    rows = _rows(capsys)
    assert rows["EPD ÷ colocated goodput, 4 images, cost model: 1E+3PD vs 4 (median of 3 arrival seeds)"][3:5] == [
        figure, result]
    best = rows["the same, best N of the topology table: 1E+2PD vs 3"]
    assert best[3:5] == ["2.72× (seeds 2.42–2.82×)", "shown"]


@pytest.mark.parametrize(
    "name, body, why",
    [
        ("control.json", b"{not json", "not JSON"),
        ("control.json", b"\xff\xfe", "not JSON"),
        ("control.json", b"[1, 2]", "not a result of `epdq bench control"),
        ("control.json", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        ("handoff.json", json.dumps({"benchmark": "control"}).encode(), "(benchmark: 'control')"),
        ("goodput-real.json", json.dumps({"benchmark": "goodput", "kind": "cost"}).encode(), "goodput --real"),
        ("control.json", json.dumps({"benchmark": "control"}).encode(), "KeyError"),
        ("control.json", json.dumps({"benchmark": "control", "targets": [{"value": 1}]}).encode(), "KeyError"),
        ("control.json", json.dumps({"benchmark": "control", "targets": 7}).encode(), "TypeError"),
        ("scale.json", json.dumps({"benchmark": "scale", "workers": "x"}).encode(), "not a scale result"),
    ],
)
def test_a_file_that_is_not_its_benchmarks_result_is_named_with_the_reason(tmp_path, capsys, name, body, why):
    (tmp_path / name).write_bytes(body)
    assert summary.main([str(tmp_path)]) == 2
    err = capsys.readouterr()
    assert why in err.err and str(tmp_path / name) in err.err and "Traceback" not in err.err
    assert err.out == ""  # nothing half-printed


def test_oversized_or_odd_files_and_folders_are_refused(tmp_path, capsys):
    big = tmp_path / "control.json"
    with open(big, "wb") as f:  # sparse: no disk used
        f.truncate(summary.MAX_FILE_BYTES + 1)
    assert summary.main([str(tmp_path)]) == 2
    assert "larger than 64 MiB" in capsys.readouterr().err
    big.unlink()
    (tmp_path / "control.json").mkdir()
    assert summary.main([str(tmp_path)]) == 2
    assert "not a regular file" in capsys.readouterr().err
    shutil.rmtree(tmp_path / "control.json")
    assert summary.main([str(tmp_path)]) == 2  # nothing there
    assert "no benchmark results in" in capsys.readouterr().err
    assert summary.main([str(tmp_path / "absent")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_an_unwritable_json_path_is_an_error_not_a_traceback(tmp_path, capsys):
    (tmp_path / "control.json").write_text(json.dumps(_control(ok_hits=True)))
    target = tmp_path / "no" / "such" / "dir" / "s.json"
    assert summary.main([str(tmp_path), "--json", str(target)]) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and "Traceback" not in err


def test_an_unreadable_file_is_named(tmp_path, capsys, monkeypatch):
    # CI runs as root, which reads a file of mode 0: the refusal is made by hand
    (tmp_path / "scale.json").write_text("{}")

    def refuse(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", refuse)
    assert summary.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "scale.json: cannot be read: Permission denied" in err and "Traceback" not in err


def test_a_run_given_a_placement_says_so_beside_its_figures(tmp_path, capsys):
    # a --pin run judged like a free one would pass for what the kernel's placement gives
    data = _control(True)
    data["config"] = {"pin": {"client": [0], "broker": [0]}, "placement": "client 0, broker 0, encoder free, pd free"}
    (tmp_path / "control.json").write_text(json.dumps(data))
    summary.main([str(tmp_path)])
    row = _rows(capsys)["epdq hit req/s at 32"]
    assert row[5].endswith("pinned: client 0, broker 0, encoder free, pd free)"), row
    data["config"] = {"pin": {}, "placement": "wherever the kernel put them (no --pin)"}
    (tmp_path / "control.json").write_text(json.dumps(data))
    summary.main([str(tmp_path)])
    assert "pinned" not in _rows(capsys)["epdq hit req/s at 32"][5]


@pytest.mark.parametrize(
    ("idle", "shown"),
    [
        ({"driver": "haltpoll", "governor": "haltpoll", "halt_poll_ns": 200000}, "idle polling 200 µs"),
        ({"driver": "haltpoll", "governor": "haltpoll", "halt_poll_ns": 0}, None),
        ({"driver": "intel_idle", "governor": "menu", "halt_poll_ns": None}, None),
        ({"halt_poll_ns": "lots"}, None),
        ("not a dict", None),
    ],
)
def test_a_run_whose_idle_cpus_polled_says_so_beside_its_figures(tmp_path, capsys, idle, shown):
    # wake-ups are several times cheaper with polling idle CPUs: such a run is not the machine's usual
    data = _control(True)
    data["environment"] = {"time_utc": "2026-12-04T06:00:00Z", "idle": idle}
    (tmp_path / "control.json").write_text(json.dumps(data))
    summary.main([str(tmp_path)])
    when = _rows(capsys)["epdq hit req/s at 32"][5]
    if shown:
        assert when.endswith(f"({shown})"), when
    else:
        assert "idle" not in when, when


def test_a_run_given_credits_says_so_beside_its_figures(tmp_path, capsys):
    # credits tuned for one concurrency would pass for what the workers' defaults give
    data = _control(True)
    data["config"] = {"epdq_credits": {"encoder": 32, "encoder_max_batch": 8, "pd": 16},
                      "credits_set": {"encoder": {"capacity": 32}}}  # fmt: skip
    (tmp_path / "control.json").write_text(json.dumps(data))
    summary.main([str(tmp_path)])
    assert _rows(capsys)["epdq hit req/s at 32"][5].endswith("credits set: encoder 32/8, pd 16)")
    for cfg in ({"epdq_credits": {"encoder": 16, "encoder_max_batch": 8, "pd": 16}, "credits_set": {}},
                {"credits_set": {"encoder": {}}, "epdq_credits": "odd"}):  # fmt: skip
        data["config"] = cfg
        (tmp_path / "control.json").write_text(json.dumps(data))
        summary.main([str(tmp_path)])
        assert "credits" not in _rows(capsys)["epdq hit req/s at 32"][5]


def test_the_run_column_names_the_host_cpu_short_and_printable(tmp_path, capsys):
    data = _control(ok_hits=True)
    data["environment"]["cpu_model"] = "Intel(R) Xeon(R) Processor"
    (tmp_path / "control.json").write_text(json.dumps(data))
    assert summary.main([str(tmp_path)]) == 0
    assert _rows(capsys)["epdq hit req/s at 32"][5] == "2026-12-03 14:06 (Intel Xeon, loop 26 ns, memcpy 6.9 GB/s)"
    data["environment"]["cpu_model"] = "\x1b[2J|" + "A" * 200  # a file from anywhere: no escapes, no cell breaks
    (tmp_path / "control.json").write_text(json.dumps(data))
    assert summary.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "AAAA" * 6 not in out
    assert "| 2026-12-03 14:06 (2J" + "A" * 22 + ", loop 26 ns, memcpy 6.9 GB/s) |" in out


def test_runs_from_machines_with_different_cpus_are_flagged(tmp_path, capsys):
    data = _control(ok_hits=True)
    data["environment"]["cpu_model"] = "AMD EPYC"
    (tmp_path / "control.json").write_text(json.dumps(data))
    scale.run(workers=10, requests=50, nodes=2, memory=False, out_dir=str(tmp_path))
    run = json.loads((tmp_path / "scale.json").read_text())
    run["environment"]["cpu_model"] = "Intel(R) Xeon(R) Processor"  # whatever this machine is
    (tmp_path / "scale.json").write_text(json.dumps(run))
    capsys.readouterr()
    assert summary.main([str(tmp_path), "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    written = json.loads((tmp_path / "s.json").read_text())
    assert "note: these runs come from 2 different CPUs (AMD EPYC: control; Intel Xeon: scale)" in out
    assert "the count mixes machines" in out and written["mixed_hosts"] is True
    assert written["hosts"] == {"control": "AMD EPYC", "scale": "Intel Xeon"}
    # one machine: no note
    (tmp_path / "scale.json").unlink()
    assert summary.main([str(tmp_path)]) == 0
    assert "different CPUs" not in capsys.readouterr().out


def test_a_run_without_its_cpu_counts_as_a_machine_of_its_own():
    assert summary.mixed_hosts({"control": "AMD EPYC", "scale": "AMD EPYC"}) is None
    note = summary.mixed_hosts({"control": "AMD EPYC", "scale": ""})
    assert note is not None and "CPU not recorded: scale" in note


def test_a_run_smaller_than_readmes_says_so_beside_its_figures(tmp_path, capsys):
    data = _control(ok_hits=True)
    data["config"] = {"requests": 1000}  # as `epdq bench all --quick` runs it
    (tmp_path / "control.json").write_text(json.dumps(data))
    assert summary.main([str(tmp_path), "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert out.count(", reduced size |") == 3  # every row of that run
    assert "note: 3 of the 3 judged figures come from runs smaller than README's (control: 1,000 requests, not 8,000)" in out
    assert json.loads((tmp_path / "s.json").read_text())["reduced"] == {"control": "1,000 requests, not 8,000"}
    data["config"] = {"requests": 8000}
    (tmp_path / "control.json").write_text(json.dumps(data))
    assert summary.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "reduced size" not in out and "smaller than README's" not in out


@pytest.mark.parametrize(
    ("name", "field", "small", "why"),
    [("handoff", "repeats", 5, "5 repeats, not 40"), ("goodput", "window_s", 30.0, "30 s windows, not 120")],
)
def test_the_reduced_sizes_of_the_other_judged_benchmarks(name, field, small, why):
    src = summary.SOURCES[f"{name}.json"]
    data = {"config": {field: small}} if name == "handoff" else {field: small}
    assert src.reduced(data) == why
    full = {"config": {field: 40}} if name == "handoff" else {field: 120.0}
    assert src.reduced(full) is None and src.reduced({}) is None


def test_full_size_is_what_epdq_bench_all_runs():
    from epdq.benchmarks import suite

    full = {name: args for name, args in suite.FULL}
    repeats = int(full["handoff"][full["handoff"].index("--repeats") + 1])
    requests = int(full["control"][full["control"].index("--requests") + 1])
    handoff, control = summary.SOURCES["handoff.json"], summary.SOURCES["control.json"]
    assert handoff.reduced({"config": {"repeats": repeats}}) is None and handoff.reduced({"config": {"repeats": repeats - 1}})
    assert control.reduced({"config": {"requests": requests}}) is None and control.reduced({"config": {"requests": requests - 1}})
    assert "--window" not in full["goodput"]  # the cost model's default window is the full one


def test_readme_shows_exactly_the_table_the_summary_prints_from_the_committed_results(capsys):
    # README's "targets at a glance" is this command's output over bench/results: a run moved in
    # or out of that folder, or a change to how a target is judged, shows up here until README follows
    assert summary.main([str(RESULTS)]) == 0
    out = capsys.readouterr().out
    printed = [line for line in out.splitlines() if line.startswith("| ")]
    readme = (RESULTS.parents[1] / "README.md").read_text().splitlines()
    met, judged = re.search(r"^(\d+) of (\d+) judged targets met$", out, re.M).groups()
    assert f"**{met} of {judged} targets met.**" in " ".join(readme)
    assert len(printed) > 20
    missing = [line for line in printed if line not in readme]
    assert not missing, f"README lacks {len(missing)} of the summary's rows, e.g. {missing[0]}"
    start = readme.index(printed[0])
    block = readme[start : start + len(printed) + 1]
    body = [line for line in block if not line.startswith("|---") and not line.startswith("|-")]
    assert body == printed, "README's copy of the table is out of order or has rows the summary does not print"
