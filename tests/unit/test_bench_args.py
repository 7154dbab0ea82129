"""Every benchmark refuses bad arguments before it starts anything: a usage error (exit 2) that
names the bad value, never a traceback halfway through a run."""

from __future__ import annotations

import importlib
import os

import pytest

from epdq.benchmarks.costmodel import CostModel, Workload

_UNUSABLE = max(set(range(4096)) - os.sched_getaffinity(0))  # a CPU number this process may not use
BAD_ARGS = [
    ("handoff", ["--sizes", "abc"], "--sizes must be numbers"),
    ("handoff", ["--sizes", "0"], "sizes must be in (0, 1024] MiB"),
    ("handoff", ["--sizes", ""], "sizes: give at least one size in MiB, e.g. 1,8,32"),  # was "got []"
    ("handoff", ["--sizes", " , "], "sizes: give at least one size in MiB"),
    ("handoff", ["--repeats", "0"], "repeats must be >= 1"),
    ("handoff", ["--pool-mib", "0"], "pool and ring sizes"),
    ("handoff", ["--device", "bogus"], "--device must be cpu, cuda or cuda:N, not 'bogus'"),
    ("control", ["--requests", "0"], "requests must be >= 1"),
    ("control", ["--concurrency", "1", "0"], "concurrency values must be 1..1024"),
    ("control", ["--concurrency", "5000"], "concurrency values must be 1..1024"),
    ("control", ["--warmup", "-1"], "warmup must be >= 0"),
    ("control", ["--pin", "gpu=0"], "--pin: 'gpu' is not a role (client, broker, encoder, pd or all)"),
    ("control", ["--pin", "0"], "--pin takes ROLE=CPUS"),
    ("control", ["--pin", "all=0", "all=0"], "--pin names all twice"),
    ("control", ["--pin", "pd=0", "pd=0"], "--pin names pd twice"),
    ("control", ["--pin", "pd=1-0"], "CPU range '1-0' runs backwards"),
    ("control", ["--pin", f"pd={_UNUSABLE}"], f"pin: cpus {_UNUSABLE} for the pd not available here"),
    ("control", ["--encoder-credit", "0"], "--encoder-credit must be 1..4096, not 0"),
    ("control", ["--pd-credit", "5000"], "--pd-credit must be 1..4096, not 5000"),
    ("control", ["--encoder-credit", "4", "--encoder-batch", "8"], "--encoder-batch (8) cannot exceed --encoder-credit (4)"),
    ("control", ["--encoder-batch", "x"], "argument --encoder-batch: invalid int value"),
    # no upper bound: --requests 2000000000 grew ~6 MB/s making images before anything ran
    ("control", ["--requests", "2000000000"], "at most 1,000,000 per phase"),
    ("control", ["--warmup", "2000000000"], "warmup must be >= 0 and at most 1,000,000"),
    ("control", ["--requests", "1000000", "--concurrency", "1", "2", "4"],
     "at most 2,000,000 fresh images per run (warm-up + requests x concurrency levels: 100,000 + 1,000,000 x 3"),
    ("goodput", ["--images", "0"], "images_per_request must be an integer in 1..64"),
    ("goodput", ["--image-size", "big"], "--image-size must be WIDTHxHEIGHT"),
    ("goodput", ["--image-size", "0x512"], "image_size must be (width, height)"),
    ("goodput", ["--qps", "1,x"], "--qps must be numbers"),
    ("goodput", ["--qps", "-2"], "--qps values must be > 0"),
    ("goodput", ["--qps", ""], "--qps: give at least one load"),  # ran the default grid
    ("goodput", ["--real", "--qps", " , "], "--qps: give at least one load"),
    ("goodput", ["--pd", "0"], "the number of PD workers must be 1..1024"),
    ("goodput", ["--topologies", "1,x"], "--topologies must be integers"),
    ("goodput", ["--topologies", "0"], "topology PD counts must be integers in 1..64"),
    ("goodput", ["--tpot-slack", "0.5"], "tpot_slack must be >= 1"),
    ("goodput", ["--repeat-fraction", "1.5"], "repeat_fraction must be in [0, 1]"),
    ("goodput", ["--output-tokens", "0"], "output_tokens must be an integer"),
    ("goodput", ["--ttft-slo", "0"], "--ttft-slo must be > 0"),
    ("goodput", ["--real", "--tpot-slo", "-1"], "--tpot-slo must be > 0"),
    ("goodput", ["--real", "--pd", "0"], "pd workers must be 1..8"),
    ("goodput", ["--real", "--window", "-1"], "window must be in (0, 600] seconds"),
    ("goodput", ["--real", "--qps", "1000", "--window", "60"], "at most 20,000 requests per load point"),
    ("goodput", ["--real", "--images", "9"], "images per request must be 0..8"),
    ("goodput", ["--real", "--image-size", "8x8"], "image size must be 14..4096"),
    ("goodput", ["--real", "--output-tokens", "0"], "output tokens must be 1..4096"),
    ("goodput", ["--window", "0"], "window_s must be > 0"),
    # a load rounded to 0.000 divided by zero after the > 0 check
    ("goodput", ["--qps", "0.0001"], "--qps values must be at least 0.001"),
    # the cost model had no bound: --qps 1000000 grew to 2.4 GB in 12 s
    ("goodput", ["--qps", "1000000"], "at most 100,000 simulated requests per load point (offered load x window"),
    ("goodput", ["--qps", "1", "--window", "100000000"], "1 x 100,000,000 s = 100,000,000"),
    ("goodput", ["--quick", "--qps", "5000"], "5,000 x 30 s"),  # --quick's window is the one checked
    # cost-model options the real kind ignored
    ("goodput", ["--real", "--tpot-slack", "2"], "--tpot-slack applies to the cost model only, not --real"),
    ("goodput", ["--real", "--topologies", "none"], "--topologies applies to the cost model only"),
    ("goodput", ["--real", "--quick"], "--quick applies to the cost model only, not --real"),
    ("goodput", ["--real", "--text-tokens", "5", "--hot-set", "2", "--repeat-fraction", "0.1"],
     "--text-tokens, --repeat-fraction, --hot-set apply to the cost model only"),
    ("scale", ["--workers", "1"], "workers must be 2..1000000"),
    ("scale", ["--requests", "0"], "requests must be 1..10000000"),
    ("scale", ["--encoder-share", "1"], "encoder_share must be between 0 and 1"),
    ("scale", ["--workers", "10", "--nodes", "11"], "nodes must be 1..workers"),
]


@pytest.mark.parametrize(("module", "argv", "message"), BAD_ARGS)
def test_bad_arguments_are_usage_errors(module, argv, message, tmp_path, capsys):
    main = importlib.import_module(f"epdq.benchmarks.{module}").main
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(tmp_path)], prog=f"epdq bench {module}")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"epdq bench {module}: error:" in err and message in err
    assert os.listdir(tmp_path) == []  # refused before anything ran or was written


@pytest.mark.parametrize(
    "kw",
    [
        {"images_per_request": 0},
        {"images_per_request": 65},
        {"images_per_request": 2.0},
        {"image_size": (512,)},
        {"image_size": (512, 0)},
        {"image_size": (512, 20000)},
        {"text_tokens": -1},
        {"output_tokens": 0},
        {"repeat_fraction": -0.1},
        {"hot_set": 0},
    ],
)
def test_workload_rejects_bad_fields(kw):
    with pytest.raises(ValueError):
        Workload(**kw)


@pytest.mark.parametrize(
    "kw",
    [{"step_s": -0.001}, {"enc_s_per_mpx": float("nan")}, {"max_batched_tokens": 0}, {"handoff_bytes_per_s": 0.0}],
)
def test_cost_model_rejects_bad_constants(kw):
    with pytest.raises(ValueError):
        CostModel(**kw)


def test_defaults_are_valid():
    Workload()
    CostModel()
    Workload(images_per_request=1, image_size=(1, 1), text_tokens=0, output_tokens=1, repeat_fraction=1.0, hot_set=1)


@pytest.mark.parametrize("module", ["handoff", "control", "goodput", "scale"])
def test_an_unusable_out_directory_is_refused_before_the_run(module, tmp_path, capsys):
    # a benchmark that runs for minutes must not end in a traceback with its results lost
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    main = importlib.import_module(f"epdq.benchmarks.{module}").main
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(blocker / "results")], prog=f"epdq bench {module}")
    assert exc.value.code == 2
    assert "is not a writable directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("module", "argv", "name"),
    [
        ("handoff", [], "handoff.json"),
        ("handoff", [], "handoff.png"),
        ("control", [], "control.json"),
        ("goodput", [], "goodput.png"),
        ("goodput", ["--real"], "goodput-real.json"),
        ("scale", [], "scale.json"),
    ],
)
def test_a_directory_where_a_result_goes_is_refused_before_the_run(module, argv, name, tmp_path, capsys):
    # before, the run went to its end and then failed writing there, in a traceback
    (tmp_path / name).mkdir()
    main = importlib.import_module(f"epdq.benchmarks.{module}").main
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(tmp_path)], prog=f"epdq bench {module}")
    assert exc.value.code == 2
    assert f"{name} is there and is a directory" in capsys.readouterr().err


def test_a_result_file_left_by_an_older_run_is_fine(tmp_path):
    from epdq.benchmarks.report import check_out_dir

    (tmp_path / "scale.json").write_text("{}")
    check_out_dir(tmp_path, ("scale.json", "scale.png"))


def test_scale_fits_its_default_node_count_to_few_workers(tmp_path, capsys):
    from epdq.benchmarks import scale

    assert scale.main(["--workers", "10", "--requests", "50", "--no-memory", "--out", str(tmp_path)]) == 0
    assert "on 10 nodes" in capsys.readouterr().out


@pytest.mark.parametrize("module", ["handoff", "control", "goodput", "scale"])
def test_an_empty_out_is_a_usage_error(module, tmp_path, capsys, monkeypatch):
    # Path("") is ".": the results landed wherever the shell stood
    monkeypatch.chdir(tmp_path)
    main = importlib.import_module(f"epdq.benchmarks.{module}").main
    with pytest.raises(SystemExit) as exc:
        main(["--out", ""], prog=f"epdq bench {module}")
    assert exc.value.code == 2
    assert "--out must name a directory, not an empty string" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_json_records_the_run_metadata(tmp_path):
    import json

    from epdq import __version__
    from epdq.benchmarks.report import write_json

    env = json.loads(write_json(tmp_path / "x.json", "x", {}).read_text())["environment"]
    assert env["epdq"] == __version__ and env["python"] and isinstance(env["argv"], list)
    assert "torch" in env and "cpu_model" in env


def test_pin_places_every_role_named_and_all_the_others():
    from epdq.benchmarks.control import parse_pin, placement

    first = min(os.sched_getaffinity(0))
    assert parse_pin([]) == {}
    assert parse_pin([f"broker={first}"]) == {"broker": (first,)}
    assert parse_pin([f"all={first}"]) == {r: (first,) for r in ("client", "broker", "encoder", "pd")}
    # all= fills the roles not named, wherever it stands
    everything = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    got = parse_pin([f"pd={everything}", f"all={first}"])
    assert got["pd"] == tuple(sorted(os.sched_getaffinity(0))) and got["client"] == (first,)
    assert placement({}) == "wherever the kernel put them (no --pin)"
    assert placement({"broker": (first,)}) == f"client free, broker {first}, encoder free, pd free"


def test_pin_given_through_the_api_is_checked_too():
    from epdq.benchmarks.control import check_pin

    with pytest.raises(ValueError, match="give the pd at least one CPU"):
        check_pin({"pd": ()})
    with pytest.raises(ValueError, match="'gpu' is not a role"):
        check_pin({"gpu": (0,)})
    first = min(os.sched_getaffinity(0))
    assert check_pin({"pd": [first], "client": (first,)}) == {"client": (first,), "pd": (first,)}


def test_credits_given_through_the_api_are_checked_and_become_role_options():
    from epdq.benchmarks.control import _credits, credit_options

    assert credit_options(None) == credit_options({}) == {}
    opts = credit_options({"encoder": 32, "pd": 8})
    assert opts == {"encoder": {"capacity": 32}, "pd": {"capacity": 8}}
    assert _credits(opts) == {"encoder": 32, "encoder_max_batch": 8, "pd": 8}
    assert _credits(credit_options({"encoder_max_batch": 4})) == {"encoder": 8, "encoder_max_batch": 4, "pd": 16}
    with pytest.raises(ValueError, match="gpu is not one of"):
        credit_options({"gpu": 1})
    with pytest.raises(ValueError, match="--pd-credit must be 1..4096, not 2.0"):
        credit_options({"pd": 2.0})
