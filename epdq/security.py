"""CURVE encryption and authentication for tcp links, and the policy saying when they are required.

tcp links use CURVE unless the operator explicitly asks for plaintext on loopback; ipc links stay
plaintext because their directory is private to the user (see `transport._prepare_ipc`), except
abstract ones (ipc://@name), which any local user can reach and so are treated like loopback. A server
socket (the broker's ROUTER, an encoder's fetch ROUTER) admits only public keys found in its allow
directory, checked by a ZAP handler (`Authenticator`) running on the socket's context.

libzmq lets a CURVE server admit *any* client key when no ZAP handler is bound on its context
(ZAP_ENFORCE_DOMAIN, which would forbid that, is a draft option pyzmq's libzmq ignores), so
`apply_server` refuses a context without a running `Authenticator`, and `Authenticator.stop`
refuses while a server socket it guards is still open.

Key files use the ZeroMQ certificate text format, which `zmq.auth.load_certificate` and czmq read.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import stat
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from epdq.errors import InternalError, InvalidInputError

log = logging.getLogger(__name__)

DEFAULT_DOMAIN = "epdq"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_MAX_KEY_FILE = 64 * 1024  # a certificate is ~300 bytes; never slurp a big file by mistake
_KEY_LINE = re.compile(rb'^\s*(public-key|secret-key)\s*=\s*"?([^"\s]*)"?\s*$')


def _z85_key(key: bytes, what: str) -> bytes:
    try:
        if len(key) == 40 and len(z85.decode(key)) == 32:
            return bytes(key)
    except (ValueError, KeyError, TypeError, IndexError):
        pass
    raise InvalidInputError(f"{what} is not a 40-character z85 CURVE key")


@dataclass(slots=True, frozen=True)
class KeyPair:
    public: bytes  # z85, 40 bytes
    secret: bytes = field(repr=False)  # kept out of logs and tracebacks

    def __post_init__(self) -> None:
        _z85_key(self.public, "public key")
        if zmq.curve_public(_z85_key(self.secret, "secret key")) != self.public:
            raise InvalidInputError("public key does not belong to the secret key")


# ------------------------------------------------------------------ key files


def _cert_text(name: str, public: bytes, secret: bytes | None) -> str:
    head = [f"#   epdq CURVE {'secret' if secret else 'public'} certificate {name!r}"]
    if secret:
        head.append("#   Never share this file or loosen its permissions (0600).")
    body = ["metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret:
        body.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(head + body) + "\n"


def generate_keypair(directory: str | Path, name: str, *, overwrite: bool = False) -> tuple[Path, Path]:
    """Write `<name>.key` (public, 0644) and `<name>.key_secret` (both keys, 0600); return (public, secret)."""
    if not _NAME.fullmatch(name):
        raise InvalidInputError(f"key name {name!r}: 1-64 of [A-Za-z0-9_.-], not starting with '.' or '-'")
    directory = Path(directory)
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True)
        directory.chmod(0o700)  # mkdir's mode is filtered by the umask
    elif not directory.is_dir():
        raise InvalidInputError(f"{directory} is not a directory")
    pub_path, sec_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    existing = [p for p in (pub_path, sec_path) if p.exists() or p.is_symlink()]
    if existing and not overwrite:
        raise InvalidInputError(f"{existing[0]} already exists; pass overwrite=True to replace the key pair")
    public, secret = zmq.curve_keypair()
    for path, text, mode in ((sec_path, _cert_text(name, public, secret), 0o600),
                             (pub_path, _cert_text(name, public, None), 0o644)):  # fmt: skip
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        # O_EXCL|O_NOFOLLOW: never write through a planted file or symlink; fchmod undoes the umask
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        try:
            os.fchmod(fd, mode)
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)  # readers never see half a file
    return pub_path, sec_path


def _read_cert(path: str | Path) -> tuple[bytes | None, bytes | None, int]:
    """(public, secret, permission bits) of a certificate file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise InvalidInputError(f"key file {path} does not exist") from None
    except OSError as e:
        raise InvalidInputError(f"cannot open key file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)  # the opened file's, so a swap after the check cannot fool it
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInputError(f"key file {path} is not a regular file")
        data = os.read(fd, _MAX_KEY_FILE + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_KEY_FILE:
        raise InvalidInputError(f"key file {path} is too large to be a certificate")
    found: dict[bytes, bytes] = {}
    for m in filter(None, map(_KEY_LINE.match, data.splitlines())):
        if m.group(1) in found:
            raise InvalidInputError(f"key file {path} has more than one {m.group(1).decode()}")
        found[m.group(1)] = _z85_key(m.group(2), f"{m.group(1).decode()} in {path}")
    return found.get(b"public-key"), found.get(b"secret-key"), stat.S_IMODE(st.st_mode)


def load_keypair(path: str | Path) -> KeyPair:
    """Read a `.key_secret` file; it must be accessible by its owner only."""
    pub, sec, mode = _read_cert(path)
    if sec is None:
        raise InvalidInputError(f"{path} holds no secret-key (is it the public .key file?)")
    if mode & 0o077:
        raise InvalidInputError(f"secret key file {path} is accessible by other users (mode {mode:o}); "
                                f"run: chmod 600 {path}")  # fmt: skip
    try:
        return KeyPair(pub or zmq.curve_public(sec), sec)
    except InvalidInputError as e:
        raise InvalidInputError(f"{path}: {e.message}") from None


def load_public_key(path: str | Path) -> bytes:
    """The z85 public key in a `.key` file (or a `.key_secret` one; its secret is not kept)."""
    pub, sec, _ = _read_cert(path)
    if pub is None and sec is None:
        raise InvalidInputError(f"{path} holds no public-key")
    return pub or zmq.curve_public(sec)


def load_allowed_keys(allow_dir: str | Path) -> frozenset[bytes]:
    """Public keys of every `*.key` file in `allow_dir`; one bad file fails the whole load."""
    allow_dir = Path(allow_dir)
    if not allow_dir.is_dir():
        raise InvalidInputError(f"allow directory {allow_dir} does not exist or is not a directory")
    if allow_dir.stat().st_mode & 0o022:  # whoever can write here can let themselves in
        raise InvalidInputError(
            f"allow directory {allow_dir} is writable by others; run: chmod go-w {allow_dir}"
        )
    return frozenset(load_public_key(p) for p in sorted(allow_dir.glob("*.key")) if p.is_file())


# ------------------------------------------------------------------ configs and policy


@dataclass(slots=True)
class CurveServer:
    keypair: KeyPair
    allow_dir: Path  # required: without an allow-list a server would admit every key
    domain: str = DEFAULT_DOMAIN  # ZAP domain: servers sharing a context with different allow-lists differ

    def __post_init__(self) -> None:
        self.allow_dir = Path(self.allow_dir)
        if not self.allow_dir.is_dir():
            raise InvalidInputError(f"allow directory {self.allow_dir} does not exist or is not a directory")
        if not 0 < len(self.domain) <= 254 or not self.domain.isascii():
            raise InvalidInputError("ZAP domain must be 1-254 ASCII characters")


@dataclass(slots=True)
class CurveClient:
    keypair: KeyPair
    server_public: bytes

    def __post_init__(self) -> None:
        self.server_public = _z85_key(self.server_public, "server public key")


@dataclass(slots=True)
class SecurityConfig:
    mode: str = "none"  # "curve" | "none"
    secret_key: Path | None = None  # own .key_secret (servers and clients)
    server_key: Path | None = None  # the broker's .key (clients, workers)
    allow_dir: Path | None = None  # allowed .key files (broker; encoders for their fetch socket)
    insecure_ok: bool = False  # plaintext tcp on loopback; never anything else

    def __post_init__(self) -> None:
        if self.mode not in ("curve", "none"):
            raise InvalidInputError(f"security mode must be 'curve' or 'none', not {self.mode!r}")
        for name, want_dir in (("secret_key", False), ("server_key", False), ("allow_dir", True)):
            value = getattr(self, name)
            if value is None:
                continue
            if self.mode == "none":  # keys without CURVE would look secure and not be
                raise InvalidInputError(f"{name} given but security mode is 'none'; use mode 'curve'")
            value = Path(value)
            if not (value.is_dir() if want_dir else value.is_file()):
                kind = "directory" if want_dir else "file"
                raise InvalidInputError(f"{name} {value} does not exist or is not a {kind}")
            setattr(self, name, value)
        if self.mode == "curve" and self.secret_key is None:
            raise InvalidInputError("security mode 'curve' needs secret_key (see generate_keypair)")

    def server(self, domain: str = DEFAULT_DOMAIN) -> CurveServer:
        if self.secret_key is None or self.allow_dir is None:
            raise InvalidInputError("a CURVE server needs secret_key and allow_dir")
        return CurveServer(load_keypair(self.secret_key), self.allow_dir, domain)

    def client(self, server_public: bytes | None = None) -> CurveClient:
        """`server_public` overrides `server_key`, e.g. an encoder's key learned over the broker link."""
        if self.secret_key is None or (server_public is None and self.server_key is None):
            raise InvalidInputError("a CURVE client needs secret_key and server_key")
        return CurveClient(load_keypair(self.secret_key), server_public or load_public_key(self.server_key))


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # a wildcard, interface or DNS name may reach the network
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def check_plaintext_allowed(address: str, config: SecurityConfig) -> None:
    """Raise unless a link at `address` may run without CURVE."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc"):
        raise InvalidInputError(f"unsupported endpoint {address!r}: use tcp://, ipc:// or inproc://")
    if scheme == "inproc" or (scheme == "ipc" and not rest.startswith("@")):
        return  # ipc files live in a 0700 directory; inproc never leaves the process
    # abstract ipc names (ipc://@x) have no permissions: any local user may connect, as on loopback
    host = "localhost" if scheme == "ipc" else rest.rpartition(";")[2].rpartition(":")[0]  # [src;]host:port
    if not _is_loopback(host):
        raise InvalidInputError(f"{address} is not a loopback address: tcp links off this host must use "
                                "CURVE (security mode 'curve' with key files)")  # fmt: skip
    if not (config.mode == "none" and config.insecure_ok):
        raise InvalidInputError(f"plaintext on {address} needs the explicit insecure option; "
                                "otherwise use CURVE or ipc://")  # fmt: skip


def curve_required(address: str, config: SecurityConfig) -> bool:
    """Whether the socket at `address` must use CURVE; raises if the address is not allowed at all."""
    if config.mode == "curve" and address.startswith(("tcp://", "ipc://@")):
        return True
    check_plaintext_allowed(address, config)
    return False


# ------------------------------------------------------------------ ZAP handler and socket options


class _AllowList:
    """Per-domain key sets checked on the ZAP thread; `reload` swaps whole frozensets (atomic)."""

    def __init__(self) -> None:
        self.dirs: dict[str, Path] = {}
        self.keys: dict[str, frozenset[bytes]] = {}
        self.denied: set[bytes] = set()  # warn once per key: a refused peer reconnects every 100 ms

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys.get(domain, ()):
            return True
        if key not in self.denied and len(self.denied) < 1024:
            self.denied.add(key)
            log.warning(
                "refused CURVE key %s (ZAP domain %r): not in the allow directory", key.decode(), domain
            )
        return False


_running: dict[int, Authenticator] = {}  # by libzmq context address, so a shadow Context maps the same
_running_lock = threading.Lock()


class Authenticator:
    """The ZAP handler of one zmq.Context, on its own thread (pyzmq's ThreadAuthenticator).

    Not the AsyncioAuthenticator: it answers handshakes from the event loop, so a busy loop stalls
    every handshake (measured: with the loop blocked a handshake never completed; on the thread it
    takes ~1.5 ms whatever the loop does), and it needs a running loop to start.
    """

    def __init__(self) -> None:
        self._zap: ThreadAuthenticator | None = None
        self._ctx_id = 0
        self._allow = _AllowList()
        self._servers: weakref.WeakSet[zmq.Socket] = weakref.WeakSet()

    def start(self, ctx: zmq.Context, allow_dir: str | Path, *, domain: str = DEFAULT_DOMAIN) -> None:
        """Guard `ctx` with the keys in `allow_dir`; before any CURVE server socket in it binds."""
        keys = load_allowed_keys(allow_dir)  # fail before starting anything
        with _running_lock:
            if self._zap is not None or ctx.underlying in _running:
                raise InternalError("an Authenticator is already running (one per context, started once)")
            self._zap = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
            self._zap.start()
            self._ctx_id = ctx.underlying
            _running[self._ctx_id] = self
        self._set(domain, Path(allow_dir), keys)

    def allow(self, allow_dir: str | Path, *, domain: str) -> None:
        """Guard another ZAP domain: a second server socket in this context with its own allow-list."""
        if self._zap is None:
            raise InternalError("Authenticator not started")
        self._set(domain, Path(allow_dir), load_allowed_keys(allow_dir))

    def _set(self, domain: str, allow_dir: Path, keys: frozenset[bytes]) -> None:
        assert self._zap is not None
        self._allow.dirs[domain], self._allow.keys[domain] = allow_dir, keys
        self._zap.configure_curve_callback(domain, self._allow)
        log.info("CURVE allow-list for ZAP domain %r: %d keys from %s", domain, len(keys), allow_dir)

    def guards(self, domain: str) -> Path | None:
        """The allow directory checked for `domain`, if this handler runs and guards it."""
        return self._allow.dirs.get(domain) if self._zap is not None else None

    def reload(self) -> dict[str, int]:
        """Re-read every allow directory (after adding or removing keys); on error the old lists stay."""
        fresh = {domain: load_allowed_keys(d) for domain, d in self._allow.dirs.items()}
        self._allow.keys.update(fresh)
        self._allow.denied.clear()
        return {domain: len(keys) for domain, keys in fresh.items()}

    def stop(self) -> None:
        """Stop the handler. Close the server sockets first: without it they would admit any key."""
        if self._zap is None:
            return
        still_open = sum(1 for s in self._servers if not s.closed)
        if still_open:
            raise InternalError(
                f"close {still_open} CURVE server socket(s) before stopping the Authenticator"
            )
        with _running_lock:
            self._zap.stop()
            self._zap = None
            _running.pop(self._ctx_id, None)


def authenticator_for(ctx: zmq.Context) -> Authenticator | None:
    with _running_lock:
        return _running.get(ctx.underlying)


def ensure_authenticator(ctx: zmq.Context, server: CurveServer) -> Authenticator:
    """The context's Authenticator (started if needed), guarding `server.domain` with its allow_dir."""
    auth = authenticator_for(ctx)
    if auth is None:
        auth = Authenticator()
        auth.start(ctx, server.allow_dir, domain=server.domain)
    elif (current := auth.guards(server.domain)) is None:
        auth.allow(server.allow_dir, domain=server.domain)
    elif current.resolve() != server.allow_dir.resolve():
        raise InvalidInputError(f"ZAP domain {server.domain!r} already uses allow directory {current}")
    return auth


def _check_unused(sock: zmq.Socket) -> None:
    if sock.getsockopt(zmq.LAST_ENDPOINT):
        raise InternalError("CURVE options must be set before the socket binds or connects")


def apply_server(sock: zmq.Socket, server: CurveServer) -> None:
    """Make `sock` a CURVE server whose clients its context's Authenticator checks. Before bind."""
    _check_unused(sock)
    auth = authenticator_for(sock.context)
    if auth is None or auth.guards(server.domain) is None:
        raise InternalError(f"no Authenticator guards ZAP domain {server.domain!r} on this socket's "
                            "context; without one libzmq admits every client key")  # fmt: skip
    sock.setsockopt(zmq.ZAP_DOMAIN, server.domain.encode())
    sock.setsockopt(zmq.CURVE_SECRETKEY, server.keypair.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, server.keypair.public)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    auth._servers.add(sock)


def apply_client(sock: zmq.Socket, client: CurveClient) -> None:
    """Make `sock` a CURVE client of the server whose public key it holds. Before connect."""
    _check_unused(sock)
    sock.setsockopt(zmq.CURVE_SECRETKEY, client.keypair.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, client.keypair.public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, client.server_public)


def peer_key(frame: object) -> str | None:
    """z85 public key of a received frame's sender (received with copy=False); None without CURVE."""
    if not isinstance(frame, zmq.Frame):
        return None
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:  # EINVAL: no authenticated user on that link
        return None
