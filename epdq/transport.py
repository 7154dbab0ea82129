"""Socket creation, endpoints and ipc files: everything about a ZeroMQ socket but its traffic.

Every socket in epdq is made by `make_socket`, so options are set in one place: LINGER 0 (close
never hangs), unlimited high-water marks (flow control is done with credits, never by ZeroMQ
blocking a send: see notes/zmq.md), ROUTER_MANDATORY (an unknown or departed peer is an error we
see, not a silent drop) and ROUTER_HANDOVER (a restarted worker may reuse its identity).

Reading and writing a socket from the event loop is `epdq.channel.Channel`.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import stat
import weakref
from collections.abc import Callable

import zmq

from epdq.errors import ConfigError
from epdq.security import (
    SecurityConfig,
    apply_client,
    apply_server,
    curve_required,
    ensure_authenticator,
)

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES_DEFAULT = 64 * 2**20

_IPC_PATH_MAX = int(getattr(zmq, "IPC_PATH_MAX_LEN", 0) or 107)  # sizeof(sockaddr_un.sun_path) - 1


def endpoint_problem(address: str, *, connect: bool = False) -> str | None:
    """Why `address` is not a ZeroMQ endpoint epdq can use, or None. ZeroMQ itself takes a tcp
    port above 65535 modulo 65536 (tcp://host:70000 listens on 4464), so ports are checked here.
    `connect`: the address is one to connect to, where a wildcard means nothing (ZeroMQ refuses a
    `*` host or port there with a bare EINVAL, and takes port 0 but never connects)."""
    if not isinstance(address, str):
        return f"an address must be a string, not {type(address).__name__}"
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        return f"address must look like tcp://HOST:PORT or ipc://PATH, got {address!r}"
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not (port == "*" or (port.isdigit() and int(port) <= 65535)):
            return f"a tcp address needs HOST:PORT with a port in 0..65535 (or *), got {address!r}"
        if connect and (host.rpartition(";")[2] in ("*", "") or port == "*" or int(port) == 0):
            return (f"{address!r} is a wildcard, an address to listen on: connect to the broker's host and port "
                    f"(tcp://HOST:PORT with a port in 1..65535)")  # fmt: skip
    elif scheme == "ipc" and len(rest.encode()) > _IPC_PATH_MAX:
        return f"an ipc path can be at most {_IPC_PATH_MAX} bytes (a Unix socket's limit), got {len(rest.encode())}"
    return None


def process_endpoint_problem(address: str, *, connect: bool) -> str | None:
    """`endpoint_problem`, for an address other processes use (a worker's broker, an encoder's
    fetch socket, `epdq up`'s broker): inproc:// reaches only sockets of one process (one ZeroMQ
    context), where a worker waited for a broker it could never find."""
    problem = endpoint_problem(address, connect=connect)
    if problem is None and address.startswith("inproc://"):
        return f"{address!r} reaches only sockets of the same process: use tcp://HOST:PORT or ipc://PATH"
    return problem


def host_port_problem(value: str, name: str) -> str | None:
    """Why `value` is not HOST:PORT with a port in 1..65535 (an HTTP listener), or None."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"{name} must be HOST:PORT with a port in 1..65535, got {value!r}"
    return None


_rand_seeded = False


def _seed_routing_ids() -> None:
    """Make a ROUTER's automatic peer identities unpredictable. libzmq gives a peer that names
    no identity b"\\x00" + a 32-bit counter that starts at libc's rand(), never seeded in this build
    (always 0x6b8b4567), and aborts the process (an assertion) when the counter reaches an identity
    a peer chose for itself: anyone who could connect could kill the broker by taking the next few
    counter values and then connecting without an identity. Seeding libc's generator once, before
    the first ROUTER, leaves them a 1 in 2**32 guess per identity taken."""
    global _rand_seeded
    if _rand_seeded:
        return
    _rand_seeded = True
    try:
        import ctypes

        ctypes.CDLL(None).srand(int.from_bytes(os.urandom(4), "little"))
    except (OSError, AttributeError):  # not a libc we know: nothing to seed
        log.debug("could not seed libc's rand() for ZeroMQ's routing ids")


def make_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    identity: bytes | None = None,
    bind: str | None = None,
    connect: str | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES_DEFAULT,
    security: SecurityConfig | None = None,
    server_public: bytes | None = None,
    before_connect: Callable[[zmq.Socket], None] | None = None,
    send_hwm: int = 0,
) -> zmq.Socket:
    """`security` None is for links that never leave the process or this user's ipc directory;
    every other caller passes one, and a tcp endpoint then gets CURVE or a clear refusal.
    `before_connect(sock)` runs once the socket is set up, before it connects (a monitor).
    `send_hwm` > 0 (a ROUTER): messages queued for one peer that does not read, beyond which a
    send to it fails (`Channel` then reports the peer unreachable) instead of holding more memory."""
    if kind == zmq.ROUTER:
        _seed_routing_ids()  # before the socket exists: its counter starts at construction
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, send_hwm)
        sock.setsockopt(zmq.RCVHWM, 0)
        # larger frames disconnect the sender before the bytes reach us
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        endpoint = bind if bind is not None else connect
        problem = endpoint_problem(endpoint, connect=bind is None) if endpoint is not None else None
        if problem:
            raise ConfigError(problem)
        if endpoint is not None and _ipv6_literal(endpoint):
            # ZeroMQ sockets are IPv4-only by default: a bind on [::1] failed with "No such device"
            # and a connect to it silently never connected. Only where the address is an IPv6
            # literal: with the option set, an IPv4 bind reports tcp://[::ffff:127.0.0.1]:PORT and a
            # host name resolves to its IPv6 address first, changing what every IPv4 setup sees.
            sock.setsockopt(zmq.IPV6, 1)
        if security is not None and endpoint is not None and curve_required(endpoint, security):
            if bind is not None:
                server = security.server()
                ensure_authenticator(ctx, server)  # before bind: no handshake may go unchecked
                apply_server(sock, server)
            else:
                apply_client(sock, security.client(server_public))
        if bind is not None:
            _prepare_ipc(bind)
            try:
                sock.bind(bind)
            except zmq.ZMQError as e:  # in use, no such interface: the operator's to fix
                raise ConfigError(f"cannot listen on {bind}: {e.strerror}") from None
            if bind.startswith("ipc://") and not bind.startswith("ipc://@"):  # @ = abstract namespace
                _remember_ipc(sock, bind[len("ipc://") :])
                os.chmod(bind[len("ipc://") :], 0o600)
        if connect is not None:
            if before_connect is not None:
                before_connect(sock)  # a monitor it attaches goes with the socket (`close_with`)
            try:
                sock.connect(connect)
            except zmq.ZMQError as e:  # the address's fault: endpoint_problem let something through
                raise ConfigError(f"cannot connect to {connect}: {e.strerror}") from None
    except BaseException:
        close_socket(sock)
        raise
    return sock


def _ipv6_literal(endpoint: str) -> bool:
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rpartition(":")[0]
    return any(h.startswith("[") for h in host.split(";"))  # [src;]host: either may be IPv6


# What must close with a socket: a monitor's reader, which would otherwise keep the context from
# terminating (ctx.term() hung after a failed connect left a HandshakeWatch open).
_closers: weakref.WeakKeyDictionary[zmq.Socket, list[Callable[[], None]]] = weakref.WeakKeyDictionary()


def close_with(sock: zmq.Socket, fn: Callable[[], None]) -> None:
    """Call `fn` when `close_socket` closes `sock` (also when `make_socket` fails after
    `before_connect` attached it). `fn` must tolerate being called again by its owner."""
    _closers.setdefault(sock, []).append(fn)


# The ipc files this process bound: ZeroMQ (4.3) never removes one, so a clean shutdown left it
# behind. Kept by socket, with the file's identity, so that only the file this bind made goes.
_bound_ipc: weakref.WeakKeyDictionary[zmq.Socket, tuple[str, int, int, int]] = weakref.WeakKeyDictionary()


def _remember_ipc(sock: zmq.Socket, path: str) -> None:
    path = os.path.abspath(path)  # a relative path must still name it after a chdir
    st = os.lstat(path)
    _bound_ipc[sock] = (path, st.st_dev, st.st_ino, os.getpid())


def close_socket(sock: zmq.Socket, linger_ms: int = 0) -> None:
    """Close `sock` and remove the ipc file it bound, if any. The file goes first: a process that
    binds the path meanwhile makes a file of its own, which is then left alone."""
    bound = _bound_ipc.pop(sock, None)
    if bound is not None:
        path, dev, ino, pid = bound
        try:
            st = os.lstat(path)
            # a forked child must not remove its parent's endpoint; nor may anyone remove a file
            # another process bound after ours was replaced
            if pid == os.getpid() and (st.st_dev, st.st_ino) == (dev, ino):
                os.unlink(path)
        except OSError:
            pass
    sock.close(linger=linger_ms)
    for fn in _closers.pop(sock, ()):
        try:
            fn()
        except Exception:  # the socket is closed; a closer's failure must not hide that
            log.warning("closing what went with a socket failed", exc_info=True)


def _prepare_ipc(address: str) -> None:
    """ipc endpoints live in a directory only this user can enter."""
    if not address.startswith("ipc://"):
        return
    path = address[len("ipc://") :]
    if path.startswith("@"):
        return
    parent = os.path.dirname(os.path.abspath(path))
    try:
        _makedirs_private(parent)
    except OSError as e:
        raise ConfigError(f"cannot listen on {address}: cannot create {parent}: {e.strerror or e}") from None
    _warn_if_shared(address, parent)
    # ZeroMQ binds an ipc path by unlinking whatever is there: a mistyped address would delete
    # the user's file, and a second broker would silently take the first one's endpoint. Only a
    # stale socket (its process gone) is replaced.
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ConfigError(f"cannot listen on {address}: {e.strerror or e}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"cannot listen on {address}: {path} exists and is not a socket (refusing to replace it)")
    # Only a refused connection says stale. A live listener whose backlog is full timed out a
    # blocking probe, and EACCES says nothing of who listens: both were taken for stale, and the
    # bind then replaced a live endpoint.
    listening = _listening(path)
    if listening is False:
        return  # a stale socket: ZeroMQ replaces it
    if listening:
        raise ConfigError(f"cannot listen on {address}: another process is listening there")
    if not os.path.lexists(path):
        return  # removed meanwhile: nothing to replace
    raise ConfigError(f"cannot listen on {address}: cannot tell whether a process listens on {path} "
                      "(refusing to replace it; remove it if it is stale)")  # fmt: skip


def _warn_if_shared(address: str, parent: str) -> None:
    """An ipc link carries no keys: what keeps other users off it is a directory only we can
    write. The socket file (0600) keeps them from connecting while we listen, but in a directory
    they can write (/tmp) another user may listen on the same path once we stop, and our peers'
    reconnects then carry prompts and images to them."""
    try:
        st = os.stat(parent)
    except OSError:
        return
    if st.st_mode & 0o022 or st.st_uid not in (os.getuid(), 0):
        log.warning("%s is in %s, a directory other users can write: while this process is stopped, "
                    "another user could listen there and receive what its peers send; use a directory "
                    "only you can write (e.g. ipc://$XDG_RUNTIME_DIR/epdq/broker.sock)", address, parent)  # fmt: skip


def _makedirs_private(path: str) -> None:
    # os.makedirs gives its mode to the last directory only: the ones made on the way would be
    # 0755 (README promises the directory is 0700; this keeps every one we create so).
    if os.path.isdir(path):
        return
    head = os.path.dirname(path)
    if head and head != path:
        _makedirs_private(head)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not os.path.isdir(path):
            raise


def ensure_private_dir(path: str) -> None:
    """Make `path` a directory only this user can enter, or check that it is one: a well-known
    directory (`$TMPDIR/epdq-<uid>`) that another local user made first, or linked elsewhere,
    would let them replace our sockets and answer our peers (ipc links carry no keys)."""
    _makedirs_private(path)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{path} is not a directory (a symlink?): refusing to put sockets there")
    if st.st_uid != os.getuid():
        raise ConfigError(f"{path} belongs to uid {st.st_uid}, not to this user: refusing to put sockets there")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours, but open to others: close it


def remove_stale_ipc_sockets(directory: str, pattern: re.Pattern[str]) -> list[str]:
    """Unlink the sockets in `directory` left by dead processes; returns the names removed.

    Only names that fullmatch `pattern` are looked at; its group 1 is the pid that bound the file.
    A file goes only when that pid is dead, it is a socket (never a symlink or anything else) owned
    by this user, and nobody accepts a connection on it: a live pid may be a process between bind
    and listen, and a pid from another pid namespace looks dead while it listens."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != uid or _listening(path) is not False:
                continue
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):  # not replaced while we looked
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue
    return removed


def _listening(path: str) -> bool | None:
    """Whether a process accepts connections on the Unix socket `path`; None when unknown."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)  # a listener with a full backlog answers EAGAIN instead of stalling us
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return False
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        probe.close()
    return True


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (a stale name's owner, for the sweeps of leftovers)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # a name's ten digits can exceed any pid
        return False
    except PermissionError:
        return True
    return True


def bound_endpoint(sock: zmq.Socket) -> str:
    ep = sock.getsockopt(zmq.LAST_ENDPOINT)
    return ep.decode() if isinstance(ep, bytes) else str(ep)
