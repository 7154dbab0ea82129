"""CPU placement (epdq.cpus): the CPU-list syntax, the configs that carry it, and real pinning
of every thread of a process, its ZeroMQ I/O thread included (checked in /proc)."""

import json
import os
import subprocess
import sys

import msgspec
import pytest

from epdq.broker import BrokerConfig
from epdq.cluster import Cluster, ClusterSpec
from epdq.cpus import MAX_CPU, check_cpus, format_cpus, parse_cpu_list
from epdq.worker.runner import WorkerConfig

pytestmark = pytest.mark.timeout(60)

FIRST = min(os.sched_getaffinity(0))
ALL = tuple(sorted(os.sched_getaffinity(0)))
# a CPU number this process may not use (the highest one: no machine here has them all)
UNUSABLE = max(set(range(MAX_CPU + 1)) - os.sched_getaffinity(0))


@pytest.mark.parametrize(
    "text, cpus",
    [("0", (0,)), ("0-2", (0, 1, 2)), ("3,1,0-1", (0, 1, 3)), (" 1 , 2 ", (1, 2)), ("5-5", (5,)),
     (f"{MAX_CPU}", (MAX_CPU,))],
)  # fmt: skip
def test_cpu_lists_in_taskset_syntax(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize(
    "text", ["", " ", "a", "1-", "-1", "2-1", "1,,2", "0x1", "1;2", "1 2", "99999", f"{MAX_CPU + 1}", "0," * 200]
)
def test_malformed_cpu_lists_are_refused(text):
    with pytest.raises(ValueError):
        parse_cpu_list(text)


@pytest.mark.parametrize("cpus", [(True,), (-1,), (MAX_CPU + 1,), (0, 0), ("0",), (1.0,), "0", None])
def test_malformed_cpu_sets_are_refused(cpus):
    with pytest.raises(ValueError):
        check_cpus(cpus)


def test_cpu_sets_are_written_back_shortest():
    assert format_cpus((0, 1, 2, 5)) == "0-2,5"
    assert format_cpus({7, 3}) == "3,7"
    assert format_cpus(()) == ""
    assert parse_cpu_list(format_cpus((0, 2, 3, 4, 9))) == (0, 2, 3, 4, 9)


def test_configs_carry_a_validated_cpu_set():
    from epdq.gateway import GatewayConfig

    assert GatewayConfig("ipc:///tmp/x.sock", cpus=[1, 0]).cpus == (0, 1)
    with pytest.raises(ValueError, match="twice"):
        GatewayConfig("ipc:///tmp/x.sock", cpus=(0, 0))
    assert BrokerConfig(address="ipc:///tmp/x.sock").cpus == ()
    assert BrokerConfig(address="ipc:///tmp/x.sock", cpus=[1, 0]).cpus == (0, 1)
    with pytest.raises(ValueError, match="twice"):
        BrokerConfig(address="ipc:///tmp/x.sock", cpus=(0, 0))
    assert WorkerConfig(role="pd", engine="noop", cpus=(2, 1)).cpus == (1, 2)
    with pytest.raises(ValueError, match="CPU number"):
        WorkerConfig(role="pd", engine="noop", cpus=(-1,))
    # as the launcher receives them: JSON, decoded strictly
    cfg = msgspec.json.decode(b'{"address": "ipc:///tmp/x.sock", "cpus": [0]}', type=BrokerConfig)
    assert cfg.cpus == (0,)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"address": "ipc:///tmp/x.sock", "cpus": ["0"]}', type=BrokerConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"role": "pd", "engine": "noop", "cpus": [true]}', type=WorkerConfig)


def test_a_cluster_places_each_role(tmp_path):
    spec = ClusterSpec(address=f"ipc://{tmp_path}/b.sock", encoders=2, pds=1, worker_defaults={"engine": "noop"},
                       cpus={"encoder": str(FIRST), "broker": [FIRST]})  # fmt: skip
    assert spec.cpus == {"encoder": (FIRST,), "broker": (FIRST,)}
    by_name = dict(Cluster(spec).worker_configs())
    assert by_name["encoder-0"].cpus == by_name["encoder-1"].cpus == (FIRST,)
    assert by_name["pd-0"].cpus == ()  # not named: wherever the kernel puts it


@pytest.mark.parametrize(
    "cpus, match",
    [({"gpu": "0"}, "not a role"), ({"pd": ""}, "at least one CPU"), ({"pd": []}, "at least one CPU"),
     ({"pd": "1-0"}, "backwards"), ({"pd": str(UNUSABLE)}, "not available here"), (["pd"], "map roles"),
     ({"gateway": "0"}, "no gateway is started")],
)  # fmt: skip
def test_a_cluster_refuses_bad_placements_before_starting(tmp_path, cpus, match):
    with pytest.raises(ValueError, match=match):
        ClusterSpec(address=f"ipc://{tmp_path}/b.sock", worker_defaults={"engine": "noop"}, cpus=cpus)


def test_the_cli_reads_role_placements():
    from cli.main import _role_cpus

    assert _role_cpus(["broker=0", "pd=1-3"]) == {"broker": "0", "pd": "1-3"}
    with pytest.raises(ValueError, match="ROLE=CPUS"):
        _role_cpus(["0-1"])
    with pytest.raises(ValueError, match="twice"):
        _role_cpus(["pd=0", "pd=1"])


_CHILD = r"""
import json, os, sys, threading
import zmq
from epdq.cpus import pin_process
from epdq.errors import ConfigError

def threads():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        out.setdefault(name, []).append(sorted(os.sched_getaffinity(int(tid))))
    return out

ctx = zmq.Context()
sock = ctx.socket(zmq.PUSH)  # the I/O thread runs from here on
sock.bind("inproc://x")
gate = threading.Event()
before = threading.Thread(target=gate.wait, name="before", daemon=True)
before.start()
want = json.loads(sys.argv[1])
pin_process(tuple(want))
after = threading.Thread(target=gate.wait, name="after", daemon=True)
after.start()
pinned = threads()
try:
    pin_process((int(sys.argv[3]),))
    refused = ""
except ConfigError as e:
    refused = e.message
pin_process(tuple(json.loads(sys.argv[2])), widen=True)
restored = threads()
gate.set()
sock.close(linger=0)
ctx.term()
print(json.dumps({"pinned": pinned, "refused": refused, "restored": restored}))
"""


def test_every_thread_is_pinned_the_zmq_io_thread_included():
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([FIRST]), json.dumps(list(ALL)), str(UNUSABLE)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    pinned = res["pinned"]
    assert any(name.startswith("ZMQbg/IO") for name in pinned), pinned
    # Python 3.11 gives its threads no OS names: the main thread and the two others share one
    assert sum(len(sets) for name, sets in pinned.items() if not name.startswith("ZMQbg")) >= 3, pinned
    assert all(sets == [[FIRST]] * len(sets) for sets in pinned.values()), pinned
    assert f"{UNUSABLE} not available" in res["refused"]
    assert all(sets == [list(ALL)] * len(sets) for sets in res["restored"].values()), res["restored"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["broker", "--address", "ipc:///nonexistent-epdq-dir/b.sock", "--cpus", "1-0"], "CPU range '1-0' runs backwards"),
     (["worker", "--role", "pd", "--engine", "noop", "--cpus", "x"], "'x' in CPU list 'x' is not a CPU number"),
     (["up", "--cpus", "gpu=0"], "--cpus: 'gpu' is not a role to place"),
     (["up", "--cpus", "0"], "--cpus takes ROLE=CPUS"),
     (["up", "--cpus", "gateway=0"], "--cpus places the gateway, but no gateway is started"),
     (["serve-http", "--cpus", "0-"], "'0-' in CPU list '0-' is not a CPU number"),
     (["up", "--cpus", f"pd={UNUSABLE}"], f"--cpus for the pd: {UNUSABLE} not available here")],
)  # fmt: skip
def test_a_bad_placement_is_a_usage_error_before_anything_starts(argv, message):
    from typer.testing import CliRunner

    from cli.main import app

    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.replace("│", " ").split())  # the usage box may wrap the line
    assert message in text, text


def test_a_process_told_to_use_a_cpu_it_may_not_exits_2_saying_which(tmp_path):
    cfg = json.dumps({"address": f"ipc://{tmp_path}/b.sock", "cpus": [UNUSABLE]})
    proc = subprocess.run([sys.executable, "-m", "epdq.launch", "broker", cfg], capture_output=True, text=True,
                          timeout=30, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"cpus {UNUSABLE} not available to this process" in proc.stderr and "(config)" in proc.stderr
    assert not (tmp_path / "b.sock").exists()  # refused before it bound anything
