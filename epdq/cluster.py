"""Start a broker and workers as real processes on this machine, and stop them all.

Used by `epdq up`, `epdq demo` and the integration tests. Children are separate processes
(`python -m epdq.launch ...`) with their output in per-process log files; they die with their
parent (PR_SET_PDEATHSIG) so a killed test run leaves no engines behind.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from epdq.broker import BrokerConfig
from epdq.client import AsyncClient
from epdq.cpus import check_cpus, format_cpus, parse_cpu_list
from epdq.errors import BrokerUnavailableError, ConfigError
from epdq.keys import ensure_cluster_keys
from epdq.transport import host_port_problem, process_endpoint_problem
from epdq.worker.runner import WorkerConfig


@dataclass(slots=True)
class ClusterSpec:
    address: str = "tcp://127.0.0.1:7700"
    encoders: int = 1
    pds: int = 1
    both: int = 0
    model: str = ""
    broker: BrokerConfig | None = None
    worker_defaults: dict = field(default_factory=dict)  # WorkerConfig fields for every worker
    nodes: dict = field(default_factory=dict)  # role -> node id override (e.g. {"pd": "node-b"})
    # role (encoder, pd, both) -> WorkerConfig fields for that role's workers, over worker_defaults
    # (e.g. {"encoder": {"capacity": 32, "max_batch": 8}})
    role_options: dict = field(default_factory=dict)
    log_dir: str = ""
    log_format: str = "text"
    start_timeout_s: float = 300.0
    keys_dir: str = ""  # CURVE keys for tcp; empty = $EPDQ_HOME/keys, created when missing
    insecure: bool = False  # plaintext tcp on loopback instead of CURVE
    metrics: str = ""  # HOST:PORT for the broker's Prometheus /metrics and /health (off when empty)
    http: str = ""  # HOST:PORT for the OpenAI-compatible gateway (off when empty)
    http_options: dict = field(default_factory=dict)  # more GatewayConfig fields (allow_dir, model_name, ...)
    # stop(): the broker refuses new requests and waits for those in flight, at most this long; a
    # worker stopped on its own (a rolling restart) drains as long (unless worker_defaults says)
    drain_timeout_s: float = 10.0
    # role (broker, encoder, pd, both, gateway) -> the CPUs its processes run on: a `taskset -c` list
    # ("0-1,4") or CPU numbers; a role not named runs wherever the kernel puts it (epdq.cpus)
    cpus: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cpus = _check_cpu_map(self.cpus)
        _check_role_options(self.role_options)
        if "gateway" in self.cpus and not self.http:
            raise ValueError("cpus places the gateway, but no gateway is started (http, --http for epdq up, is empty)")
        # the broker listens here and every worker and client connects here: no wildcard
        problem = process_endpoint_problem(self.address, connect=True)
        if problem:
            raise ValueError(problem)
        for name in ("metrics", "http"):
            value = getattr(self, name)
            problem = host_port_problem(value, name) if value else None
            if problem:
                raise ValueError(problem)
        if self.http and self.metrics and _same_listener(self.http, self.metrics):
            # the gateway could not bind, and the broker's /health there passed for the gateway's
            raise ValueError(f"http and metrics cannot both listen on {self.http} (the gateway and "
                             f"the broker's metrics endpoint): give them different ports")  # fmt: skip
        if {"broker_address", "host", "port"} & set(self.http_options):
            raise ValueError("http_options cannot set broker_address, host or port (use http=HOST:PORT)")
        if self.http:  # the gateway starts last: a bad option must not wait for every worker to load
            from epdq.gateway import GatewayConfig

            host, port = _split_host_port(self.http)
            GatewayConfig(self.address, host=host, port=port, **self.http_options)
        if min(self.encoders, self.pds, self.both) < 0:
            raise ValueError("worker counts must be >= 0")
        if self.encoders + self.pds + self.both == 0:
            raise ValueError("a cluster needs at least one worker")
        if (self.encoders == 0) != (self.pds == 0):
            raise ValueError("the disaggregated route needs both encoders and pd workers (or neither)")
        if self.log_format not in ("text", "json"):
            raise ValueError("log_format must be text or json")
        if not 0 <= self.drain_timeout_s <= 3600:
            raise ValueError("drain_timeout_s must be in [0, 3600]")
        if self.model:  # each worker checks it too, but only after the broker and the others started
            from epdq.worker.runner import resolve_model

            resolve_model(self.model)


CPU_ROLES = ("broker", "encoder", "pd", "both", "gateway")
WORKER_ROLES = ("encoder", "pd", "both")
_SET_BY_CLUSTER = ("role", "broker", "model", "worker_id", "keys_dir", "insecure")


def _check_role_options(options: dict) -> None:
    """Refused now, before anything starts: a role that is no worker's, a field WorkerConfig does
    not have or the cluster sets itself, or a value that worker's config refuses."""
    if not isinstance(options, dict):
        raise ValueError(f"role_options must map roles ({', '.join(WORKER_ROLES)}) to WorkerConfig fields")
    known = {f.name for f in dataclasses.fields(WorkerConfig)}
    for role, opts in options.items():
        if role not in WORKER_ROLES:
            raise ValueError(f"role_options: {role!r} is not a worker role ({', '.join(WORKER_ROLES)})")
        if not isinstance(opts, dict):
            raise ValueError(f"role_options for the {role}: a dict of WorkerConfig fields, not {type(opts).__name__}")
        bad = sorted(str(k) for k in opts if k not in known or k in _SET_BY_CLUSTER)
        if bad:
            raise ValueError(f"role_options for the {role}: {', '.join(bad)} cannot be set per role")
        try:
            WorkerConfig(role=role, **opts)
        except ValueError as e:
            raise ValueError(f"role_options for the {role}: {e}") from None


def _check_cpu_map(cpus: dict) -> dict[str, tuple[int, ...]]:
    if not isinstance(cpus, dict):
        raise ValueError(f"cpus must map roles ({', '.join(CPU_ROLES)}) to CPU lists")
    out = {}
    for role, value in cpus.items():
        if role not in CPU_ROLES:
            raise ValueError(f"cpus: {role!r} is not a role to place ({', '.join(CPU_ROLES)})")
        try:
            out[role] = parse_cpu_list(value) if isinstance(value, str) else check_cpus(value)
        except ValueError as e:
            raise ValueError(f"cpus for the {role}: {e}") from None
        if not out[role]:
            raise ValueError(f"cpus for the {role}: name at least one CPU (or leave the role out)")
        # children inherit this process's set: say so now, not when one of them exits at start
        allowed = os.sched_getaffinity(0)
        missing = set(out[role]) - allowed
        if missing:
            raise ValueError(f"cpus for the {role}: {format_cpus(missing)} not available here "
                             f"(this process may use {format_cpus(allowed)})")  # fmt: skip
    return out


@dataclass(slots=True)
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    log_offset: int = 0  # where this child's lines start in log_path
    kind: str = ""  # broker | worker | gateway
    cfg: object = None  # what it was started with (a restart reuses it)
    restarts: int = 0  # crashes in a row (a long healthy run starts the count again)
    started: float = field(default_factory=time.monotonic)
    restart_at: float | None = None  # it exited: when the supervisor starts it again
    # it exited leaving processes in its group (pid -> start time), SIGTERMed; SIGKILLed at kill_at
    leftovers: dict[int, int] = field(default_factory=dict)
    kill_at: float = 0.0

    def tail(self, n: int = 40) -> str:
        """The last `n` lines this process wrote (not its predecessors' in the same file)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return "\n".join(f.read().decode(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def how_it_ended(rc: int) -> str:
    """`exited with code 1`, `was killed by SIGKILL`: Popen's negative codes are signals."""
    if rc >= 0:
        return f"exited with code {rc}"
    try:
        return f"was killed by {signal.Signals(-rc).name}"
    except ValueError:
        return f"was killed by signal {-rc}"


def die_with_parent() -> None:
    """preexec_fn for children: SIGTERM them when the parent dies (Linux PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


class Cluster:
    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.children: list[Child] = []
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.log_dir = Path(spec.log_dir) if spec.log_dir else None
        self.address = spec.address
        self.keys_dir = spec.keys_dir

    def _spawn(self, name: str, kind: str, cfg: object) -> Child:
        assert self.log_dir is not None
        path = self.log_dir / f"{name}.log"
        out = open(path, "ab")  # noqa: SIM115 - the child owns it
        offset = out.tell()  # a restarted child appends to its predecessor's log
        cmd = [
            sys.executable,
            "-m",
            "epdq.launch",
            kind,
            msgspec.json.encode(cfg).decode(),
            self.spec.log_format,
        ]
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent, start_new_session=True,
        )  # fmt: skip
        out.close()
        child = Child(name, proc, path, offset, kind, cfg)
        self.children.append(child)
        return child

    def respawn(self, old: Child) -> Child:
        """Start `old` again with the same settings (its log continues in the same file)."""
        self.children.remove(old)
        child = self._spawn(old.name, old.kind, old.cfg)
        child.restarts = old.restarts + 1
        return child

    async def supervise(
        self, *, max_restarts: int = 5, say=lambda _m: None, interval_s: float = 0.5,
        backoff_s: float = 1.0, backoff_max_s: float = 30.0, stable_s: float = 600.0, kill_after_s: float = 3.0,
    ) -> None:  # fmt: skip
        """Until cancelled: restart any child that exits, up to `max_restarts` crashes in a row
        each; then RuntimeError with its last log lines. Workers re-register by themselves, and
        find a restarted broker again (its in-flight requests fail, typed, as after any broker
        restart).

        A crashed child is started again after `backoff_s`, doubling with each crash in a row up
        to `backoff_max_s`, so that a cause that passes (a port briefly taken, a peer still
        restarting) gets time to; one that ran `stable_s` before crashing starts its count again
        (long, since the run includes loading the model: one that loads for minutes, then fails,
        is a crash loop all the same).
        A child that exits 0 was told to stop and drained (a rolling restart: SIGTERM one process
        at a time): it is started again at once, without counting against `max_restarts` (also
        when that is 0: it did not crash).

        What an exited child started and left running (a SIGKILLed worker's engine processes) gets
        SIGTERM at once, which lets vLLM's remove their shared memory, and SIGKILL `kill_after_s`
        later (or at the restart, if that comes first)."""
        while True:
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            for ch in list(self.children):
                rc = ch.proc.poll()
                if rc is None:
                    continue
                planned = rc == 0
                if ch.restart_at is None:  # found it exited just now
                    ch.leftovers = group_members(ch.proc.pid)
                    signal_members(ch.proc.pid, ch.leftovers, signal.SIGTERM)
                    if not planned and now - ch.started >= stable_s:
                        ch.restarts = 0  # not part of a crash loop
                    if not planned and ch.restarts >= max_restarts:
                        raise RuntimeError(
                            f"{ch.name} {how_it_ended(rc)}"
                            + (f" after {ch.restarts} restarts in a row" if ch.restarts else "")
                            + f"; its last log lines:\n{ch.tail()}"
                        )
                    delay = 0.0 if planned else min(backoff_s * 2**ch.restarts, backoff_max_s)
                    ch.restart_at = now + delay
                    ch.kill_at = now + min(delay, kill_after_s)
                    if planned:
                        say(f"{ch.name} exited with code 0 (told to stop, e.g. SIGTERM, after its drain); "
                            f"starting it again (log: {ch.log_path})")  # fmt: skip
                    else:
                        say(f"{ch.name} {how_it_ended(rc)}; restarting it in {delay:g} s "
                            f"({ch.restarts + 1}/{max_restarts}; log: {ch.log_path})")  # fmt: skip
                if ch.leftovers and now >= ch.kill_at:
                    # not later: once its last member is gone the group's id is free, and a new
                    # session could be given it (a killpg at the restart, up to 30 s on, hit that)
                    signal_members(ch.proc.pid, ch.leftovers, signal.SIGKILL)
                    ch.leftovers = {}
                if now >= ch.restart_at:
                    new = self.respawn(ch)
                    if planned:
                        new.restarts = ch.restarts

    def worker_configs(self) -> list[tuple[str, WorkerConfig]]:
        out = []
        for role, n in (("encoder", self.spec.encoders), ("pd", self.spec.pds), ("both", self.spec.both)):
            for i in range(n):
                kw = {"drain_timeout_s": self.spec.drain_timeout_s} | dict(self.spec.worker_defaults)
                if role == "encoder":
                    kw.pop("kv_cache_bytes", None)  # the LLM engines' setting: an encoder refuses it
                else:
                    kw.pop("max_batch", None)  # an encoder's setting: the others refuse it
                kw.update(self.spec.role_options.get(role, {}))
                kw.update(role=role, broker=self.address, model=self.spec.model, worker_id=f"{role}-{i}",
                          keys_dir=self.keys_dir, insecure=self.spec.insecure)  # fmt: skip
                if role in self.spec.nodes:
                    kw["node"] = self.spec.nodes[role]
                if role in self.spec.cpus:
                    kw["cpus"] = self.spec.cpus[role]
                out.append((f"{role}-{i}", WorkerConfig(**kw)))
        return out

    async def start(self, progress=None) -> None:
        say = progress or (lambda _msg: None)
        if self.log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="epdq-cluster-")
            self.log_dir = Path(self._tmp.name)
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot use {self.log_dir} as the log directory: {e.strerror or e}") from None
        if self.spec.http:
            _check_port_free(*_split_host_port(self.spec.http))
        bcfg = self.spec.broker or BrokerConfig(address=self.address)
        if self.address.startswith("tcp://") and not self.spec.insecure:
            try:
                self.keys_dir = str(ensure_cluster_keys(self.spec.keys_dir or None))
            except OSError as e:
                raise ConfigError(f"cannot write CURVE keys to {self.spec.keys_dir or 'the default keys directory'}: "
                                  f"{e.strerror or e}") from None  # fmt: skip
        bcfg = dataclasses.replace(bcfg, address=self.address, keys_dir=self.keys_dir, insecure=self.spec.insecure,
                                   drain_timeout_s=self.spec.drain_timeout_s)  # fmt: skip
        if self.spec.metrics:
            bcfg = dataclasses.replace(bcfg, metrics_address=self.spec.metrics)
        if "broker" in self.spec.cpus:
            bcfg = dataclasses.replace(bcfg, cpus=self.spec.cpus["broker"])
        say(f"starting broker on {self.address}")
        broker = self._spawn("broker", "broker", bcfg)
        want = {"encoder": self.spec.encoders, "pd": self.spec.pds, "both": self.spec.both}
        if self.spec.model == "" and self.spec.worker_defaults.get("engine", "auto") == "auto":
            from epdq.models.tiny import default_model_dir

            say("preparing the embedded tiny model")
            await asyncio.to_thread(default_model_dir)  # build once, before workers race for it
        await self._wait_listening(broker)
        for name, wcfg in self.worker_configs():
            say(f"starting {name}")
            self._spawn(name, "worker", wcfg)
        await self.wait_ready(want, say)
        if self.spec.http:
            host, port = _split_host_port(self.spec.http)
            gcfg = dict(self.spec.http_options, broker_address=self.address, host=host, port=port,
                        keys_dir=self.keys_dir, insecure=self.spec.insecure)  # fmt: skip
            if "gateway" in self.spec.cpus:
                gcfg["cpus"] = self.spec.cpus["gateway"]
            say(f"starting the HTTP gateway on {self.http_url}")
            self._spawn("gateway", "gateway", gcfg)
            await self._wait_http(host, port)

    @property
    def http_url(self) -> str:
        """Base URL of the gateway (`http=` in the spec), e.g. http://127.0.0.1:8000."""
        if not self.spec.http:
            return ""
        host, port = _split_host_port(self.spec.http)
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def _wait_http(self, host: str, port: int) -> None:
        """Until the gateway answers GET /health with 200 (it is 503 until it reaches the broker)
        and GET /v1/models with its model list: another server on that port answers /health too
        (the broker's metrics endpoint did, and `up` said the API was up while the gateway, which
        could not bind, crash-looped). Raises once a child, the gateway included, has exited."""
        host = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
        deadline = time.monotonic() + self.spec.start_timeout_s
        while True:
            self.check_alive()
            try:
                if (await _http_get(host, port, "/health"))[0] == 200 and _is_model_list(
                    *await _http_get(host, port, "/v1/models")
                ):
                    return
            except (OSError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway not healthy after {self.spec.start_timeout_s}s; logs in {self.log_dir}")
            await asyncio.sleep(0.2)

    async def _wait_listening(self, broker: Child) -> None:
        """Until OUR broker says it listens. Until then a client (and a worker) at its address
        could be talking to another broker already there, which ours then fails to displace."""
        deadline = time.monotonic() + self.spec.start_timeout_s
        while True:
            self.check_alive()
            try:
                with open(broker.log_path, "rb") as f:
                    f.seek(broker.log_offset)
                    if b"broker listening on" in f.read():
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"broker not listening after {self.spec.start_timeout_s}s; logs in {self.log_dir}")
            await asyncio.sleep(0.05)

    async def wait_ready(self, want: dict[str, int], say=lambda _m: None) -> dict:
        deadline = time.monotonic() + self.spec.start_timeout_s
        last = None
        async with self.client() as c:
            while True:
                self.check_alive()
                try:
                    stats = await c.stats(timeout=2.0)
                except BrokerUnavailableError:
                    stats = None
                if stats is not None:
                    have = {r: int(stats["gauges"].get(f"workers_{r}", 0)) for r in want}
                    if have != last:
                        say("registered workers: " + ", ".join(f"{r} {have[r]}/{want[r]}" for r in want))
                        last = have
                    if all(have[r] >= want[r] for r in want):
                        return stats
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"cluster not ready after {self.spec.start_timeout_s}s; logs in {self.log_dir}"
                    )
                await asyncio.sleep(0.25)

    def restart_broker(self, *, kill: bool = True) -> None:
        """Stop the broker (SIGKILL by default) and start a new one at the same address."""
        old = self.child("broker")
        if kill:
            kill_child(old)
        else:
            old.proc.terminate()
            old.proc.wait(15)
        self.respawn(old)

    def client(self, **kw) -> AsyncClient:
        """A client with this cluster's keys."""
        return AsyncClient(self.address, keys_dir=self.keys_dir, insecure=self.spec.insecure, **kw)

    def check_alive(self) -> None:
        for ch in self.children:
            rc = ch.proc.poll()
            if rc is not None:
                raise RuntimeError(f"{ch.name} exited with code {rc}; last log lines:\n{ch.tail()}")

    def child(self, name: str) -> Child:
        for ch in self.children:
            if ch.name == name:
                return ch
        raise KeyError(name)

    def stop(self, timeout: float = 15.0, *, now: bool = False) -> None:
        """The broker first: SIGTERM makes it refuse new requests and wait for those in flight,
        which the workers, still running, finish, while the gateway keeps answering (429 for new
        requests, /health 503: a load balancer sees a draining server, not a refused connection);
        then the gateway; then the workers, which find the broker gone and leave at once (rings
        unlinked). `now`: SIGINT to all, no drain."""
        drain = 0.0 if now else self.spec.drain_timeout_s
        timeout = max(timeout, drain + 5.0)
        sig = signal.SIGINT if now else signal.SIGTERM
        order = ("broker", "gateway", "worker")
        for group in [[c for c in self.children if c.kind == k] for k in order] + [
            [c for c in self.children if c.kind not in order]
        ]:
            for ch in group:
                if ch.proc.poll() is None:
                    ch.proc.send_signal(sig)
            end = time.monotonic() + timeout
            for ch in group:
                try:
                    ch.proc.wait(max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    kill_group(ch)
                    ch.proc.wait(5)
        self.children.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    async def __aenter__(self) -> Cluster:
        try:
            await self.start()
        except BaseException:
            self.stop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.stop)


def kill_group(ch: Child) -> None:
    """SIGKILL a child that did not stop in time, and the processes it started (a worker's vLLM
    EngineCore): each child leads a process group of its own. Killed alone, a worker still loading
    left its EngineCore waiting 5 minutes for a handshake with it."""
    if not signal_group(ch, signal.SIGKILL):
        ch.proc.kill()


def signal_group(ch: Child, sig: int) -> bool:
    """Signal the process group `ch` leads (it, and what it started), while `ch` has not been
    reaped (its pid, the group's id, is still taken then). False if that was refused. Once it has
    been reaped, see `signal_members`."""
    try:
        os.killpg(ch.proc.pid, sig)
    except ProcessLookupError:
        pass  # nobody left in it
    except OSError:
        return False
    return True


def group_members(pgid: int) -> dict[int, int]:
    """The processes in process group `pgid` (pid -> start time in clock ticks), from /proc."""
    members = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return members
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()  # the name before it may hold anything
        except OSError:
            continue  # gone meanwhile
        if len(fields) > 19 and int(fields[2]) == pgid:
            members[pid] = int(fields[19])
    return members


def signal_members(pgid: int, members: dict[int, int], sig: int) -> bool:
    """Signal process group `pgid` of a child already reaped, if one of `members` (seen in it
    before) is still there: a group's id is not given to a new process while it has members, but
    once they are gone it may be, and a killpg would hit a stranger's group. False if not sent."""
    current = group_members(pgid)
    if not any(current.get(pid) == start for pid, start in members.items()):
        return False
    try:
        os.killpg(pgid, sig)
    except OSError:
        return False
    return True


def kill_child(ch: Child) -> None:
    """SIGKILL one child (chaos tests)."""
    os.kill(ch.proc.pid, signal.SIGKILL)
    ch.proc.wait(10)


async def _http_get(host: str, port: int, path: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """Status and body of GET `path` (at most 64 KiB read); (0, b"") if that is no HTTP answer."""
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            raw = b""
            while len(raw) < 1 << 16 and (chunk := await reader.read(1 << 16)):
                raw += chunk
        finally:
            writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    return (int(status[1]) if len(status) >= 2 and status[1].isdigit() else 0), body


def _is_model_list(status: int, body: bytes) -> bool:
    try:
        return status == 200 and json.loads(body).get("object") == "list"
    except (ValueError, AttributeError):
        return False


def _same_listener(a: str, b: str) -> bool:
    """Whether HOST:PORT `a` and `b` would take the same listening socket: the same port on the
    same host, or on a wildcard address (which takes it on every address)."""
    (ha, pa), (hb, pb) = _split_host_port(a), _split_host_port(b)
    if pa != pb:
        return False
    loopback = {"localhost": "127.0.0.1", "[::1]": "::1"}
    ha, hb = (loopback.get(h.lower(), h.lower().strip("[]")) for h in (ha, hb))
    wildcards = ("0.0.0.0", "::", "*", "")
    return ha == hb or ha in wildcards or hb in wildcards


def _split_host_port(value: str) -> tuple[str, int]:
    """HOST:PORT (checked by ClusterSpec) as (host, port)."""
    host, _, port = value.rpartition(":")
    return host, int(port)


def _check_port_free(host: str, port: int) -> None:
    """The gateway starts last, after every worker has loaded: a port already taken must fail
    the start at once instead (a probe; the gateway's own bind still decides)."""
    from epdq.gateway import bind_sockets

    for sock in bind_sockets(host, port):
        sock.close()
