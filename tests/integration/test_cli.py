"""The `epdq` command as a user runs it: demo, and up (+ HTTP gateway, metrics) + generate + Ctrl-C."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from epdq.demo import demo_image
from tests.integration.helpers import wait_stats
from tests.procs import readline

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

EPDQ = [sys.executable, "-m", "cli.main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_demo_runs_and_matches_colocated():
    addr = f"tcp://127.0.0.1:{free_port()}"
    p = subprocess.run([*EPDQ, "demo", "--address", addr], capture_output=True, text=True, timeout=500)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "cluster ready" in out and "stopping the cluster" in out
    rows = [
        line for line in out.splitlines() if line.startswith(("text only", "one image", "repeated image"))
    ]
    assert len(rows) == 3 and all(" yes " in r for r in rows), out[-4000:]
    assert "1 served from the embedding cache" in out or "served from the embedding cache" in out


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _sample(metrics: str, name: str, labels: str = "") -> float:
    for line in metrics.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name}{labels} not in metrics:\n{metrics}")


def test_up_http_generate_status_and_sigterm_drains_and_stops_everything(tmp_path):
    addr = f"tcp://127.0.0.1:{free_port()}"
    http_port, metrics_port = free_port(), free_port()
    up = subprocess.Popen(
        [*EPDQ, "up", "--address", addr, "--log-dir", str(tmp_path / "logs"), "--http", f"127.0.0.1:{http_port}",
         "--metrics", f"127.0.0.1:{metrics_port}", "--model-name", "tiny", "--log-format", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            line = readline(up, max(1.0, deadline - time.monotonic()))
            assert line, "epdq up exited early:\n" + "".join(lines)
            lines.append(line)
            if "Ctrl-C stops everything" in line:  # the last line of the banner
                break
        else:
            pytest.fail("epdq up did not come up:\n" + "".join(lines))
        children = _children(up.pid)
        assert len(children) == 4  # broker, encoder, pd, gateway
        assert f"http://127.0.0.1:{http_port}/v1" in "".join(lines)

        image = tmp_path / "pic.png"
        image.write_bytes(demo_image(5, (112, 112)))
        g = subprocess.run(
            [*EPDQ, "generate", "Describe.", "--image", str(image), "--address", addr, "--json", "--max-tokens", "6"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert g.returncode == 0, g.stderr
        result = json.loads(g.stdout)
        assert len(result["token_ids"]) >= 1 and result["timings"]["route"] == "epd"

        # the same request through the gateway `up` started, streamed by the official openai client
        import openai

        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0, timeout=120)
        url = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe."}]
        chunks = list(oa.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0,
            stream=True,
        ))  # fmt: skip
        oa.close()
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == result["text"]  # same model, same prompt, greedy: same tokens

        code, gm = _get(f"http://127.0.0.1:{http_port}/metrics")
        assert code == 200
        assert _sample(gm, "epdq_gateway_requests_total", '{code="200",mode="stream"}') == 1
        assert _sample(gm, "epdq_gateway_completion_tokens_total") == len(result["token_ids"])
        assert _sample(gm, "epdq_gateway_images_total") == 1
        assert _sample(gm, "epdq_gateway_ttft_seconds_count") == 1
        assert _sample(gm, "epdq_gateway_in_flight") == 0
        code, bm = _get(f"http://127.0.0.1:{metrics_port}/metrics")
        assert code == 200
        assert _sample(bm, "epdq_requests_completed_total") >= 2
        assert _sample(bm, "epdq_cache_hits_total") >= 1  # the gateway's image was the CLI's image
        assert _sample(bm, "epdq_workers", '{role="encoder",state="idle"}') == 1
        assert _get(f"http://127.0.0.1:{metrics_port}/health")[0] == 200
        assert _get(f"http://127.0.0.1:{http_port}/health")[0] == 200

        st = subprocess.run([*EPDQ, "status", addr, "--once", "--json"], capture_output=True, text=True, timeout=60)
        assert st.returncode == 0, st.stderr
        status = json.loads(st.stdout)
        assert status["workers_by_role"] == {"encoder": 1, "pd": 1, "both": 0}
        assert status["requests"]["completed"] >= 1 and status["ring"]["capacity_bytes"] > 0
        table = subprocess.run([*EPDQ, "status", addr, "--once"], capture_output=True, text=True, timeout=60)
        assert table.returncode == 0 and "encoder-0" in table.stdout and "hit rate" in table.stdout

        bad = subprocess.run(
            [*EPDQ, "generate", "x", "--image", str(tmp_path), "--address", addr], capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert bad.returncode == 2 and "invalid_input" in bad.stderr  # 2: fix the input

        # SIGTERM (as systemd or docker stop send; Ctrl-C takes the same path) while a long request
        # streams: the broker refuses new requests and waits for it, so it still completes in full
        long = subprocess.Popen(
            [*EPDQ, "generate", "Tell a long story.", "--image", str(image), "--address", addr, "--json",
             "--max-tokens", "1500"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while _sample(_get(f"http://127.0.0.1:{metrics_port}/metrics")[1], "epdq_requests_running") < 1:
            assert time.monotonic() < deadline and long.poll() is None, "the long request did not start"
            time.sleep(0.02)
        os.kill(up.pid, signal.SIGTERM)
        # the gateway stays up while the broker drains (it used to stop at once: connection
        # refused), and tells a load balancer so
        deadline = time.monotonic() + 20
        while (health := _get(f"http://127.0.0.1:{http_port}/health"))[0] != 503:
            assert time.monotonic() < deadline and long.poll() is None, health
            time.sleep(0.05)
        assert "draining" in health[1]
        out, err = long.communicate(timeout=60)
        assert long.returncode == 0, err
        long_result = json.loads(out)
        assert long_result["finish_reason"] in ("length", "stop")
        rest, _ = up.communicate(timeout=60)
        assert up.returncode == 0, rest
        assert "stopping" in rest
        assert "drained" in (tmp_path / "logs" / "broker.log").read_text()  # it waited for the long one
        for pid in children:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)

        # --log-format json: epdq's lines are JSON objects, and so are vLLM's (in the worker and in its
        # engine process); what C code prints stays text. Request lines carry ids.
        events = []
        for log_file in (tmp_path / "logs").glob("*.log"):
            for line in log_file.read_text().splitlines():
                if line.startswith("{"):
                    events.append(json.loads(line))
        vllm_pids = {e["pid"] for e in events if e["logger"].startswith("vllm")}
        assert len(vllm_pids) >= 2, vllm_pids  # worker processes and their engine processes
        done = [e for e in events if e.get("event") == "request_done" and e["logger"] == "epdq.gateway"]
        assert len(done) == 1 and done[0]["request_id"].startswith("chatcmpl-") and done[0]["status"] == 200
        assert done[0]["prompt_tokens"] > 0
        upstream = done[0]["upstream_request_id"]  # the gateway's line names the broker's id
        done = [e for e in events if e.get("event") == "request_done" and e["logger"] == "epdq.broker"]
        # the CLI's request and the gateway's, each with its id and timings; and the long one
        assert len(done) == 3, done
        assert {e["request_id"] for e in done} == {result["request_id"], upstream, long_result["request_id"]}
        done = [e for e in done if e["request_id"] != long_result["request_id"]]
        for e in done:
            assert e["route"] == "epd" and e["tokens"] == len(result["token_ids"]) and e["images"] == 1
            assert e["prompt_tokens"] > 0
            assert 0 < e["ttft_s"] <= e["total_s"] and e["worker"] == "pd-0"
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait(10)
        up.stdout.close()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["keygen", "/dev/null/keys"], "error (config): cannot write keys to /dev/null/keys: /dev/null/keys: a part"),
        (["make-model", "/dev/null/model"], "error (config): cannot write the model to /dev/null/model:"),
        (["bench", "scale", "--workers", "1"], "epdq bench scale: error: workers must be 2..1000000"),
        (["bench", "handoff", "--out", "/dev/null/out"], "--out '/dev/null/out' is not a writable directory"),
        (["bench", "summary", "/dev/null"], "epdq bench summary: error: /dev/null: not a directory"),
    ],
)
def test_unwritable_paths_and_bad_bench_flags_are_one_line_errors(argv, message):
    r = subprocess.run([*EPDQ, *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr
    assert "Traceback" not in r.stderr and "│" not in r.stderr  # no (rich) traceback


def test_start_up_problems_are_one_line_errors(tmp_path):
    """An address someone else listens on, or a model directory that is not a checkpoint: one
    line and a non-zero exit, from `broker`, `worker` and `up` alike; `up` never attaches to
    the other broker it finds at its address."""
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    (tmp_path / "no-weights").mkdir()  # a partial copy: the config, no weights
    (tmp_path / "no-weights" / "config.json").write_text('{"model_type": "qwen2_vl"}')
    (tmp_path / "no-processor").mkdir()
    (tmp_path / "no-processor" / "config.json").write_text('{"model_type": "qwen2_vl"}')
    (tmp_path / "no-processor" / "model.safetensors").write_bytes(b"")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    tcp = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
    ipc_path = tmp_path / "sock" / "broker.sock"
    ipc_path.parent.mkdir(mode=0o700)
    other = socket.socket(socket.AF_UNIX)
    other.bind(str(ipc_path))
    other.listen()
    stale = tmp_path / "sock" / "stale.sock"
    gone = socket.socket(socket.AF_UNIX)
    gone.bind(str(stale))
    gone.close()  # the file stays, nobody listens: a broker may take it over
    precious = tmp_path / "sock" / "notes.txt"  # a mistyped address must not delete a file
    precious.write_text("mine")
    try:
        cases = [
            (["broker", "--address", tcp, "--insecure"], "error (config): cannot listen on " + tcp),
            (["broker", "--address", f"ipc://{ipc_path}"], "another process is listening there"),
            (["broker", "--address", f"ipc://{precious}"], "exists and is not a socket (refusing to replace it)"),
            (["broker", "--address", "tcp://127.0.0.1:0", "--insecure", "--metrics", busy.getsockname()[0]
              + f":{busy.getsockname()[1]}"], "error (config): cannot serve metrics on"),  # fmt: skip
            (["worker", "--role", "pd", "--model", str(tmp_path / "nope")], "error (config): model directory"),
            (["worker", "--role", "pd", "--model", str(tmp_path / "not-a-model")], "has no config.json"),
            (["worker", "--role", "encoder", "--model", str(tmp_path / "llama")], "is a 'llama' checkpoint; epdq serves"),
            (["worker", "--role", "pd", "--model", str(tmp_path / "no-weights")], "has no weights (model.safetensors"),
            (["worker", "--role", "encoder", "--model", str(tmp_path / "no-processor")], "has no preprocessor_config.json"),
            (["up", "--address", f"ipc://{ipc_path}", "--log-dir", str(tmp_path / "logs"), "--encoders", "0",
              "--pds", "0", "--both", "1"], "another process is listening there"),  # fmt: skip
            # `epdq demo` used to end these with an 88-line traceback
            (["demo", "--address", f"ipc://{ipc_path}"], "another process is listening there"),
            # before anything starts (it used to start the broker, then report a worker's exit code)
            (["up", "--address", f"ipc://{tmp_path}/sock/up.sock", "--log-dir", str(tmp_path / "logs"),
              "--model", str(tmp_path / "llama")], "error (config): "),  # fmt: skip
        ]
        for argv, message in cases:
            r = subprocess.run([*EPDQ, *argv], capture_output=True, text=True, timeout=120)
            assert r.returncode in (1, 2) and message in r.stderr, (argv, r.returncode, r.stderr[-2000:])
            assert "Traceback" not in r.stderr and "│" not in r.stderr, argv
            if argv[0] == "up":
                assert "registered workers" not in r.stdout and "epdq is up" not in r.stdout
            if "--model" in argv:  # refused by the argument checks: nothing was started or stopped
                assert "stopping" not in r.stdout + r.stderr and "exited with code" not in r.stderr
        assert precious.read_text() == "mine"
        # a stale socket file is no obstacle
        broker = subprocess.Popen([*EPDQ, "broker", "--address", f"ipc://{stale}"], stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while broker.poll() is None and time.monotonic() < deadline:
                probe = socket.socket(socket.AF_UNIX)
                try:
                    probe.connect(str(stale))
                    break
                except OSError:
                    time.sleep(0.1)
                finally:
                    probe.close()
            assert broker.poll() is None, broker.stderr.read()
        finally:
            broker.terminate()
            broker.wait(30)
            broker.stderr.close()
    finally:
        busy.close()
        other.close()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-queued", "0"], "--max-queued must be >= 1, got 0"),  # the flag, not the config field
        (["--heartbeat", "0"], "--heartbeat must be in"),
        (["--max-held-image-mb", "0"], "--max-held-image-mb (in bytes) must be >= 1, got 0"),
        (["--max-image-mb", "100"], "--max-image-mb (in bytes) must be in"),
        (["--address", "nowhere"], "address must look like"),
        (["--timeout", "nan"], "--timeout must be in (0, 3600] s, got nan"),
        (["--log-format", "xml"], "log format must be text or json"),
        (["worker", "--role", "pd", "--log-format", "xml"], "log format must be text or json"),
        (["worker", "--role", "pd", "--node", "n" * 200], "node must be at most 128 characters"),
        (["--address", "tcp://127.0.0.1:70000", "--insecure"], "a port in 0..65535"),
        (["--metrics", "localhost"], "--metrics must be HOST:PORT"),
        (["worker", "--role", "pd", "--broker", "tcp://127.0.0.1:70000"], "a port in 0..65535"),
        (["--drain-timeout", "-1"], "--drain-timeout must be in [0, 3600]"),
        (["worker", "--role", "pd", "--drain-timeout", "7200"], "--drain-timeout must be in [0, 3600]"),
        (["up", "--drain-timeout", "-5"], "--drain-timeout must be in [0, 3600]"),
        (["demo", "--address", "foo"], "address must look like"),  # was a traceback
        # options that used to be ignored without a word
        (["up", "--colocated", "--encoders", "3"], "--colocated runs colocated workers only: drop --encoders"),
        (["worker", "--role", "pd", "--fetch-bind", "tcp://127.0.0.1:1"], "--fetch-bind and --fetch-advertise are encoder"),
        (["serve-http", "--allow-private-urls"], "--allow-private-urls widens --allow-remote-urls, which is off"),
    ],
)
def test_bad_broker_worker_and_up_settings_are_usage_errors(argv, message, tmp_path):
    command = argv[0] if argv[0] in ("worker", "up", "demo", "serve-http") else "broker"
    argv = argv[1:] if command != "broker" else argv
    own = command in ("worker", "serve-http") or "--address" in argv
    address = [] if own else ["--address", f"ipc://{tmp_path}/b.sock"]
    r = subprocess.run([*EPDQ, command, *address, *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Invalid value" in r.stderr and "Traceback" not in r.stderr, r.stderr[-1500:]
    assert message in " ".join(r.stderr.replace("│", " ").split())  # the box may wrap the line


def test_up_with_an_unusable_log_or_keys_directory_or_http_port_says_so_in_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        for argv, message in (
            (["--address", f"ipc://{tmp_path}/b.sock", "--log-dir", str(blocker)], "as the log directory"),
            (["--address", "tcp://127.0.0.1:7790", "--log-dir", str(tmp_path / "logs"), "--keys-dir",
              str(blocker / "k")], "cannot write CURVE keys to"),
            # the gateway starts after every worker has loaded: a taken port must fail at once
            (["--address", f"ipc://{tmp_path}/b.sock", "--log-dir", str(tmp_path / "logs"), "--http",
              f"127.0.0.1:{busy.getsockname()[1]}"], "cannot serve HTTP on 127.0.0.1:"),
        ):  # fmt: skip
            r = subprocess.run([*EPDQ, "up", *argv], capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and message in r.stderr, r.stderr[-1500:]
            assert "Traceback" not in r.stderr and "stopping" not in r.stdout  # nothing had started
    finally:
        busy.close()


async def test_an_encoder_of_an_ipc_cluster_needs_no_keys(tmp_path):
    """With an ipc:// broker and no CURVE keys anywhere, `epdq worker --role encoder` used to stop
    at start-up: its default --fetch-bind was tcp, which needs keys."""
    env = {**os.environ, "EPDQ_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    addr = f"ipc://{tmp_path}/sock/b.sock"
    procs = [subprocess.Popen([*EPDQ, "broker", "--address", addr], env=env, stderr=subprocess.PIPE, text=True)]
    try:
        procs.append(subprocess.Popen([*EPDQ, "worker", "--role", "encoder", "--engine", "noop", "--broker", addr],
                                      env=env, stderr=subprocess.PIPE, text=True))  # fmt: skip
        await wait_stats(addr, lambda s: s["gauges"]["workers_encoder"] == 1, timeout=60)
        assert not (tmp_path / "home" / "keys").exists()
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(30)
            p.stderr.close()


def test_a_worker_the_broker_refuses_says_why_and_exits(tmp_path):
    """An encoder of another model: the broker refuses it (BYE, refused). It used to log "register
    again" every 5 s forever; now it says why, once, and exits 2 for its supervisor to report."""
    import zmq

    from epdq import protocol as P

    env = {**os.environ, "EPDQ_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    addr = f"ipc://{tmp_path}/sock/b.sock"
    broker = subprocess.Popen([*EPDQ, "broker", "--address", addr], env=env, stderr=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    first = ctx.socket(zmq.DEALER)
    first.setsockopt(zmq.LINGER, 0)
    try:
        # an encoder of some other model registers first: the broker's scope becomes its
        first.connect(addr)
        first.send_multipart(P.encode(P.Register("enc-other", "encoder", "n", 1, "other-model-scope", "m", 1)))
        assert first.poll(30_000), "the broker did not answer"
        assert isinstance(P.decode(first.recv_multipart())[0], P.Registered)
        t0 = time.monotonic()
        r = subprocess.run([*EPDQ, "worker", "--role", "encoder", "--engine", "noop", "--broker", addr],
                           env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 2, r.stderr[-2000:]
        assert "the broker refused this worker: model scope 'noop-vision-v1' differs" in r.stderr, r.stderr[-2000:]
        assert "registering again" not in r.stderr and time.monotonic() - t0 < 30
        # once the other model's last encoder has left (a model upgrade), the new model's is taken
        # (it used to be refused until the broker restarted)
        first.send_multipart(P.encode(P.Bye("shutdown")))
        r = subprocess.Popen([*EPDQ, "worker", "--role", "encoder", "--engine", "noop", "--broker", addr],
                             env=env, stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while True:
                line = r.stderr.readline()
                assert line and time.monotonic() < deadline, "the new model's encoder did not register"
                if "registered with broker" in line:
                    break
                assert "refused" not in line, line
        finally:
            r.terminate()
            r.wait(30)
            r.stderr.close()
    finally:
        first.close()
        ctx.term()
        broker.terminate()
        broker.wait(30)
        broker.stderr.close()


def test_serve_http_on_a_taken_port_is_one_line_and_sigterm_exits_0(tmp_path, unused_tcp_port):
    """A port in use was exit 3 after uvicorn's "startup complete"; a SIGTERM'd gateway drained
    and then died of the signal uvicorn re-raised (-15), which `epdq up` counted as a crash."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    base = [*EPDQ, "serve-http", "--broker", f"ipc://{tmp_path}/nobody.sock"]
    try:
        r = subprocess.run([*base, "--port", str(busy.getsockname()[1])], capture_output=True, text=True, timeout=60)
    finally:
        busy.close()
    assert r.returncode == 2 and "error (config): cannot serve HTTP on 127.0.0.1:" in r.stderr, r.stderr
    assert "startup complete" not in r.stderr
    for argv, message in (  # these were a traceback after "startup complete", and exit 3
        (["--broker", "foo"], "address must look like"),
        (["--broker", "tcp://10.1.2.3:7841", "--insecure"], "not a loopback address"),
    ):
        r = subprocess.run([*EPDQ, "serve-http", *argv, "--port", str(unused_tcp_port)], capture_output=True,
                           text=True, timeout=60)  # fmt: skip
        assert r.returncode == 2 and "error (config): " in r.stderr and message in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    gw = subprocess.Popen([*base, "--port", str(unused_tcp_port)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", unused_tcp_port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and gw.poll() is None, gw.stderr.read()
                time.sleep(0.1)
        gw.send_signal(signal.SIGTERM)
        assert gw.wait(30) == 0
    finally:
        if gw.poll() is None:
            gw.kill()
            gw.wait(10)
        gw.stderr.close()


async def test_a_stream_cut_by_its_deadline_ends_its_line_before_the_error(tmp_path):
    from epdq.cluster import Cluster
    from tests.integration.helpers import noop_spec

    spec = noop_spec(tmp_path, worker_defaults={"engine": "noop", "noop_token_s": 0.2})
    async with Cluster(spec) as cluster:
        proc = await asyncio.create_subprocess_exec(
            *EPDQ, "generate", "slow", "--address", cluster.address, "--max-tokens", "50", "--timeout", "1.5",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 3 and b"error (deadline)" in err, err
    assert out and out.endswith(b"\n")  # the partial answer used to run into the shell prompt
