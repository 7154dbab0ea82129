"""Linux network namespaces joined by a bridge, for tests that need separate "hosts" on one machine.

`NetLab` builds, per test run:

    <tag>-br        a namespace holding bridge br0 (the "switch")
    <tag>-<host>    one namespace per host, with lo up and eth0 = 10.X.Y.<n>/24 on the switch
    epq<pid>h<k>    a veth in the root namespace, 10.X.Y.1/24 on the switch, so the test process
                    reaches every host directly

where <tag> is `epdqnt-<pid>-<k>`. Names carry the pid so parallel runs never collide; namespaces
and host links of runs whose pid is gone are removed before a new lab is built (`remove_stale`).
`close()` ends every process started through the lab (SIGTERM, then SIGKILL of its process group,
then SIGKILL of anything still inside the namespaces) and deletes the namespaces and the root
veth; it is safe to call twice and after a partial `build()`.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from epdq.cluster import die_with_parent
from epdq.transport import pid_alive as _pid_alive

NS_PREFIX = "epdqnt-"
_NS_RE = re.compile(rf"^{NS_PREFIX}(\d+)-\d+-\S+$")
_LINK_RE = re.compile(r"^epq(\d+)h\d+$")
_counter = itertools.count()


class NetnsUnavailable(Exception):
    """Network namespaces cannot be made here (not root, no `ip`, no permission): skip, don't fail."""


def ip(*args: str, check: bool = True, timeout: float = 15.0) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=timeout)


def _kill_ns_pids(ns: str) -> None:
    r = ip("netns", "pids", ns, check=False)
    for tok in r.stdout.split():
        if tok.isdigit():
            try:
                os.kill(int(tok), signal.SIGKILL)
            except ProcessLookupError:
                pass


def list_namespaces() -> list[str]:
    r = ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Delete namespaces and root links left by earlier runs (by this prefix) whose pid is dead."""
    removed = []
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _kill_ns_pids(ns)
            ip("netns", "del", ns, check=False)
            removed.append(ns)
    r = ip("-o", "link", "show", check=False)
    for line in r.stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        m = _LINK_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def check_available() -> None:
    """Raise NetnsUnavailable with the reason when this process cannot build a lab."""
    if os.geteuid() != 0:
        raise NetnsUnavailable(f"network namespaces need root (ip netns add); running as uid {os.geteuid()}")
    if shutil.which("ip") is None:
        raise NetnsUnavailable("the `ip` command (iproute2) is not installed")
    probe = f"{NS_PREFIX}{os.getpid()}-{next(_counter)}-probe"
    r = ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        raise NetnsUnavailable(f"`ip netns add` failed here: {r.stderr.strip() or r.returncode}")
    try:
        r = ip("-n", probe, "link", "add", "vp0", "type", "veth", "peer", "name", "vp1", check=False)
        if r.returncode != 0:
            raise NetnsUnavailable(f"cannot create veth pairs: {r.stderr.strip()}")
        r = ip("-n", probe, "link", "add", "brp", "type", "bridge", check=False)
        if r.returncode != 0:
            raise NetnsUnavailable(f"cannot create a bridge: {r.stderr.strip()}")
    finally:
        ip("netns", "del", probe, check=False)


def _free_subnet(pid: int) -> str:
    """A private 10.213.Y.0/24 not already routed in the root namespace ("10.213.Y")."""
    routes = ip("-4", "route", "show", check=False).stdout + ip("-4", "-o", "addr", check=False).stdout
    for i in range(254):
        y = (pid + i) % 254 + 1
        prefix = f"10.213.{y}"
        if f"{prefix}." not in routes:
            return prefix
    raise NetnsUnavailable("no free 10.213.Y.0/24 subnet in the root namespace")


@dataclass
class Proc:
    name: str
    ns: str
    popen: subprocess.Popen
    log_path: Path
    watch: bool = True  # check_alive() fails when it has exited

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class NetLab:
    hosts: list[str]
    log_dir: Path
    tag: str = ""
    subnet: str = ""  # "10.213.Y"
    host_link: str = ""
    addrs: dict[str, str] = field(default_factory=dict)  # host name -> IPv4 address
    namespaces: dict[str, str] = field(default_factory=dict)  # host name ("br" too) -> netns name
    procs: list[Proc] = field(default_factory=list)

    @property
    def root_addr(self) -> str:
        return f"{self.subnet}.1"

    def build(self) -> NetLab:
        check_available()
        remove_stale()
        pid, k = os.getpid(), next(_counter)
        self.tag = f"{NS_PREFIX}{pid}-{k}"
        self.subnet = _free_subnet(pid)
        self.host_link = f"epq{pid}h{k}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        br = self._add_ns("br")
        ip("-n", br, "link", "add", "br0", "type", "bridge")
        ip("-n", br, "link", "set", "br0", "up")
        # the test process's own port on the switch
        ip("link", "add", self.host_link, "type", "veth", "peer", "name", "vroot", "netns", br)
        ip("-n", br, "link", "set", "vroot", "master", "br0", "up")
        ip("addr", "add", f"{self.root_addr}/24", "dev", self.host_link)
        ip("link", "set", self.host_link, "up")
        for i, host in enumerate(self.hosts):
            ns = self._add_ns(host)
            addr = f"{self.subnet}.{i + 2}"
            port = f"v{i}"
            ip("-n", br, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", br, "link", "set", port, "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            self.addrs[host] = addr
        return self

    def _add_ns(self, host: str) -> str:
        ns = f"{self.tag}-{host}"
        ip("netns", "add", ns)
        self.namespaces[host] = ns
        ip("-n", ns, "link", "set", "lo", "up")  # engines talk to themselves over loopback
        return ns

    def spawn(
        self, name: str, host: str, argv: list[str], env: dict[str, str] | None = None, *, watch: bool = True
    ) -> Proc:
        """Start `argv` inside `host`'s namespace (ip netns exec keeps the environment); output in
        `log_dir/<name>.log`. `watch=False`: a command expected to exit (check_alive ignores it)."""
        ns = self.namespaces[host]
        path = self.log_dir / f"{name}.log"
        out = open(path, "ab")  # noqa: SIM115 - the child owns it
        try:
            popen = subprocess.Popen(
                ["ip", "netns", "exec", ns, *argv], stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env, preexec_fn=die_with_parent, start_new_session=True,
            )  # fmt: skip
        finally:
            out.close()
        proc = Proc(name, ns, popen, path, watch)
        self.procs.append(proc)
        return proc

    def run(self, host: str, argv: list[str], timeout: float = 15.0) -> subprocess.CompletedProcess:
        """Run a short command inside `host`'s namespace and return its output."""
        return subprocess.run(["ip", "netns", "exec", self.namespaces[host], *argv], capture_output=True,
                              text=True, timeout=timeout, check=False)  # fmt: skip

    def check_alive(self) -> None:
        for p in self.procs:
            rc = p.popen.poll()
            if rc is not None and p.watch:
                raise RuntimeError(
                    f"{p.name} (netns {p.ns}) exited with code {rc}; last log lines:\n{p.tail()}"
                )

    def stop(self, proc: Proc, timeout: float = 15.0) -> None:
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
        try:
            proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        try:  # whatever it started (engine subprocesses) is in its session / process group
            os.killpg(proc.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        # workers first (they say BYE and unlink their rings), the broker last
        ordered = sorted(self.procs, key=lambda p: p.name == "broker")
        for p in ordered:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        end = time.monotonic() + 20
        for p in ordered:
            self.stop(p, timeout=max(0.1, end - time.monotonic()))
        self.procs.clear()
        for ns in self.namespaces.values():
            _kill_ns_pids(ns)
        for ns in self.namespaces.values():
            ip("netns", "del", ns, check=False)
        self.namespaces.clear()
        if self.host_link:
            ip("link", "del", self.host_link, check=False)  # normally gone with its peer already

    def __enter__(self) -> NetLab:
        try:
            return self.build()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()
