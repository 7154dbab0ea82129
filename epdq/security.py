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

Every problem found here (a key file, an allow directory, an address that would need keys) is a
setting of this process, so it is a `ConfigError`: the CLI prints it as `error (config): ...`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import stat
import struct
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from epdq.errors import ConfigError, InternalError

log = logging.getLogger(__name__)

DEFAULT_DOMAIN = "epdq"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_MAX_KEY_FILE = 64 * 1024  # a certificate is ~300 bytes; never slurp a big file by mistake
_KEY_LINE = re.compile(rb'^\s*(public-key|secret-key)\s*=\s*"?([^"\s]*)"?\s*$')


def _z85_key(key: bytes, what: str) -> bytes:
    try:
        if len(key) == 40 and len(z85.decode(key)) == 32:
            return bytes(key)
    # struct.error: a group of 5 z85 characters can spell up to 85**5 > 2**32 (a typo in a key
    # file), which pyzmq's decoder packs as a 32-bit integer: every malformed key is a ConfigError
    except (ValueError, KeyError, TypeError, IndexError, struct.error):
        pass
    raise ConfigError(f"{what} is not a 40-character z85 CURVE key")


@dataclass(slots=True, frozen=True)
class KeyPair:
    public: bytes  # z85, 40 bytes
    secret: bytes = field(repr=False)  # kept out of logs and tracebacks

    def __post_init__(self) -> None:
        _z85_key(self.public, "public key")
        if zmq.curve_public(_z85_key(self.secret, "secret key")) != self.public:
            raise ConfigError("public key does not belong to the secret key")


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
        raise ConfigError(f"key name {name!r}: 1-64 of [A-Za-z0-9_.-], not starting with '.' or '-'")
    directory = Path(directory)
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True)
        directory.chmod(0o700)  # mkdir's mode is filtered by the umask
    elif not directory.is_dir():
        raise ConfigError(f"{directory} is not a directory")
    pub_path, sec_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    existing = [p for p in (pub_path, sec_path) if p.exists() or p.is_symlink()]
    if existing and not overwrite:
        raise ConfigError(f"{existing[0]} already exists; pass overwrite=True to replace the key pair")
    public, secret = zmq.curve_keypair()
    # The secret first: two files cannot be replaced at once, and a crash between them leaves a
    # secret without its public file, which `epdq keygen` rebuilds from it (epdq.keys). The other
    # order would leave a public key that nobody holds the secret of.
    _write_atomically(sec_path, _cert_text(name, public, secret), 0o600)
    _write_atomically(pub_path, _cert_text(name, public, None), 0o644)
    return pub_path, sec_path


def write_public_key(path: str | Path, name: str, public: bytes) -> Path:
    """Write (or replace) the public certificate `path` (0644) holding `public`, atomically."""
    path = Path(path)
    _write_atomically(path, _cert_text(name, public, None), 0o644)
    return path


def _write_atomically(path: Path, text: str, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    # O_EXCL|O_NOFOLLOW: never write through a planted file or symlink; fchmod undoes the umask
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        try:
            os.fchmod(fd, mode)
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)  # readers never see half a file
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read_cert(path: str | Path, *, admitted: bool = False) -> tuple[bytes | None, bytes | None, int]:
    """(public, secret, permission bits) of a certificate file. `admitted`: a key in an allow
    directory, which lets its holder in: it must be a file of its own there (not a symlink), owned
    by this user or root and writable by nobody else; whoever can change it can let themselves in."""
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_NOFOLLOW | os.O_NONBLOCK if admitted else 0))
    except FileNotFoundError:
        raise ConfigError(f"key file {path} does not exist") from None
    except OSError as e:
        if admitted and os.path.islink(path):  # O_NOFOLLOW's ELOOP
            raise ConfigError(f"allowed key file {path} is a symlink: refusing it (copy the key file "
                              "into the allow directory instead)") from None  # fmt: skip
        raise ConfigError(f"cannot open key file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)  # the opened file's, so a swap after the check cannot fool it
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"key file {path} is not a regular file")
        if admitted:
            _check_admitted(path, st)
        data = os.read(fd, _MAX_KEY_FILE + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_KEY_FILE:
        raise ConfigError(f"key file {path} is too large to be a certificate")
    found: dict[bytes, bytes] = {}
    for m in filter(None, map(_KEY_LINE.match, data.splitlines())):
        if m.group(1) in found:
            raise ConfigError(f"key file {path} has more than one {m.group(1).decode()}")
        found[m.group(1)] = _z85_key(m.group(2), f"{m.group(1).decode()} in {path}")
    return found.get(b"public-key"), found.get(b"secret-key"), stat.S_IMODE(st.st_mode)


def load_keypair(path: str | Path) -> KeyPair:
    """Read a `.key_secret` file; it must be accessible by its owner only."""
    pub, sec, mode = _read_cert(path)
    if sec is None:
        raise ConfigError(f"{path} holds no secret-key (is it the public .key file?)")
    if mode & 0o077:
        raise ConfigError(f"secret key file {path} is accessible by other users (mode {mode:o}); "
                                f"run: chmod 600 {path}")  # fmt: skip
    try:
        return KeyPair(pub or zmq.curve_public(sec), sec)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e.message}") from None


def _check_admitted(path: str | Path, st: os.stat_result) -> None:
    if st.st_uid not in (os.getuid(), 0):
        raise ConfigError(f"allowed key file {path} belongs to uid {st.st_uid}, not to this user or root: "
                          "refusing it (whoever owns it can put their own key there)")  # fmt: skip
    if st.st_mode & 0o022:
        raise ConfigError(f"allowed key file {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
                          f"run: chmod go-w {path}")  # fmt: skip


def load_public_key(path: str | Path, *, admitted: bool = False) -> bytes:
    """The z85 public key in a `.key` file (or a `.key_secret` one; its secret is not kept).
    `admitted`: a file of an allow directory, with its stricter checks (`_read_cert`)."""
    pub, sec, _ = _read_cert(path, admitted=admitted)
    if pub is None and sec is None:
        raise ConfigError(f"{path} holds no public-key")
    return pub or zmq.curve_public(sec)


def _key_files(allow_dir: Path, pattern: str) -> list[Path]:
    """The files named `pattern` in `allow_dir`, symlinks included (they are refused when read,
    not skipped: a key the operator meant to allow must not vanish silently); subdirectories not."""
    try:
        found = sorted(allow_dir.glob(pattern))
        return [p for p in found if p.is_symlink() or not p.is_dir()]
    except OSError as e:
        raise ConfigError(f"cannot list allow directory {allow_dir}: {e.strerror or e}") from None


def load_allowed_keys(allow_dir: str | Path) -> frozenset[bytes]:
    """Public keys of every `*.key` file in `allow_dir`; one bad file fails the whole load."""
    allow_dir = Path(allow_dir)
    if not allow_dir.is_dir():
        raise ConfigError(f"allow directory {allow_dir} does not exist or is not a directory")
    if allow_dir.stat().st_mode & 0o022:  # whoever can write here can let themselves in
        raise ConfigError(
            f"allow directory {allow_dir} is writable by others; run: chmod go-w {allow_dir}"
        )
    return frozenset(load_public_key(p, admitted=True) for p in _key_files(allow_dir, "*.key"))


WORKER_KEY_GLOB = "worker*.key"  # in the allow directory: the keys that may register workers


def load_worker_keys(allow_dir: str | Path) -> frozenset[bytes]:
    """The allow directory's worker keys (files named `worker*.key`): only a peer holding one of
    them may register as a worker; every other allowed key is a client's.

    Re-read at every registration, so a file may have gone bad since the allow-list was loaded: that
    file's key is then left out (logged), and the other workers' keys still count. Raises only
    ConfigError (the directory itself cannot be read)."""
    keys = set()
    for p in _key_files(Path(allow_dir), WORKER_KEY_GLOB):
        try:
            keys.add(load_public_key(p, admitted=True))
        except ConfigError as e:
            log.error("worker key refused: %s", e.message)
    return frozenset(keys)


# ------------------------------------------------------------------ configs and policy


@dataclass(slots=True)
class CurveServer:
    keypair: KeyPair
    allow_dir: Path | None  # the admitted keys' files; or None with `allowed_keys`
    domain: str = DEFAULT_DOMAIN  # ZAP domain: servers sharing a context with different allow-lists differ
    allowed_keys: frozenset[bytes] | None = None  # a fixed list, for servers whose peers hold a known key

    def __post_init__(self) -> None:
        # exactly one list: without any a server would admit every key
        if (self.allow_dir is None) == (self.allowed_keys is None):
            raise ConfigError("a CURVE server needs either an allow directory or a list of allowed keys")
        if self.allow_dir is not None:
            self.allow_dir = Path(self.allow_dir)
            if not self.allow_dir.is_dir():
                raise ConfigError(f"allow directory {self.allow_dir} does not exist or is not a directory")
        else:
            self.allowed_keys = frozenset(_z85_key(k, "allowed key") for k in self.allowed_keys)
        if not 0 < len(self.domain) <= 254 or not self.domain.isascii():
            raise ConfigError("ZAP domain must be 1-254 ASCII characters")


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
    allow_dir: Path | None = None  # allowed .key files (the broker)
    insecure_ok: bool = False  # plaintext tcp on loopback; never anything else
    # A server without allow_dir admits only peers holding this process's own key pair: workers.
    # Encoders serve fetches to PD workers, which connect with the same worker key pair (they pin it
    # as the encoder's key), so a worker needs no allow-list of its own.
    admit_own_key: bool = False
    keys_dir: Path | None = None  # where keys were looked for; only to say so in messages

    def __post_init__(self) -> None:
        if self.mode not in ("curve", "none"):
            raise ConfigError(f"security mode must be 'curve' or 'none', not {self.mode!r}")
        for name, want_dir in (("secret_key", False), ("server_key", False), ("allow_dir", True)):
            value = getattr(self, name)
            if value is None:
                continue
            if self.mode == "none":  # keys without CURVE would look secure and not be
                raise ConfigError(f"{name} given but security mode is 'none'; use mode 'curve'")
            value = Path(value)
            if not (value.is_dir() if want_dir else value.is_file()):
                kind = "directory" if want_dir else "file"
                raise ConfigError(f"{name} {value} does not exist or is not a {kind}")
            setattr(self, name, value)
        if self.mode == "curve" and self.secret_key is None:
            raise ConfigError("security mode 'curve' needs secret_key (see generate_keypair)")

    def server(self, domain: str | None = None) -> CurveServer:
        if self.secret_key is not None and self.allow_dir is not None:
            return CurveServer(load_keypair(self.secret_key), self.allow_dir, domain or DEFAULT_DOMAIN)
        if self.secret_key is not None and self.admit_own_key:
            pair = load_keypair(self.secret_key)
            # a domain of its own: in a process that also runs a broker its allow-list stays apart
            return CurveServer(pair, None, domain or f"{DEFAULT_DOMAIN}-own-{pair.public.decode()}",
                               allowed_keys=frozenset((pair.public,)))  # fmt: skip
        where = f"{self.keys_dir}/allowed" if self.keys_dir else "an allow directory (allow_dir)"
        raise ConfigError(f"a CURVE server needs {where}: run `epdq keygen` on the keys directory and pass it "
                          "with --keys-dir")  # fmt: skip

    def client(self, server_public: bytes | None = None) -> CurveClient:
        """`server_public` overrides `server_key`, e.g. an encoder's key learned over the broker link."""
        if self.secret_key is None or (server_public is None and self.server_key is None):
            raise ConfigError("a CURVE client needs secret_key and server_key")
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
        raise ConfigError(f"unsupported endpoint {address!r}: use tcp://, ipc:// or inproc://")
    if scheme == "inproc" or (scheme == "ipc" and not rest.startswith("@")):
        return  # ipc files live in a 0700 directory; inproc never leaves the process
    # abstract ipc names (ipc://@x) have no permissions: any local user may connect, as on loopback
    host = "localhost" if scheme == "ipc" else rest.rpartition(";")[2].rpartition(":")[0]  # [src;]host:port
    if config.mode == "curve":  # curve_required covers tcp: only a direct call gets here
        raise ConfigError(f"plaintext on {address} is not allowed: this process has CURVE keys")
    if not _is_loopback(host):
        raise ConfigError(f"{address} is not a loopback address: tcp off this host must use CURVE (--insecure "
                          f"allows plaintext only on loopback); {_keys_hint(config)}, or use ipc:// on one host")
    if not config.insecure_ok:
        raise ConfigError(f"plaintext on {address} needs --insecure (insecure=True in Python), which loopback "
                          f"alone allows; for CURVE instead {_keys_hint(config)}, or use ipc://")


def _keys_hint(config: SecurityConfig) -> str:
    if config.insecure_ok:
        return "run `epdq keygen` and pass its directory with --keys-dir instead of --insecure"
    missing = f" (there are no keys in {config.keys_dir})" if config.keys_dir else ""
    return f"run `epdq keygen`{missing} or pass the cluster's keys directory with --keys-dir"


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
        self.dirs: dict[str, Path | None] = {}  # None: a fixed list, not re-read by reload
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

    def start(
        self, ctx: zmq.Context, allow_dir: str | Path | None, *, domain: str = DEFAULT_DOMAIN,
        keys: frozenset[bytes] | None = None,
    ) -> None:  # fmt: skip
        """Guard `ctx` with the keys in `allow_dir` (or exactly `keys`); before any CURVE server
        socket in it binds."""
        allow_dir, keys = _allow_source(allow_dir, keys)  # fail before starting anything
        with _running_lock:
            if self._zap is not None or ctx.underlying in _running:
                raise InternalError("an Authenticator is already running (one per context, started once)")
            self._zap = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
            self._zap.start()
            self._ctx_id = ctx.underlying
            _running[self._ctx_id] = self
        self._set(domain, allow_dir, keys)

    def allow(self, allow_dir: str | Path | None, *, domain: str, keys: frozenset[bytes] | None = None) -> None:
        """Guard another ZAP domain: a second server socket in this context with its own allow-list."""
        if self._zap is None:
            raise InternalError("Authenticator not started")
        self._set(domain, *_allow_source(allow_dir, keys))

    def _set(self, domain: str, allow_dir: Path | None, keys: frozenset[bytes]) -> None:
        assert self._zap is not None
        self._allow.dirs[domain], self._allow.keys[domain] = allow_dir, keys
        self._zap.configure_curve_callback(domain, self._allow)
        log.info("CURVE allow-list for ZAP domain %r: %d keys from %s", domain, len(keys),
                 allow_dir or "this process's own key pair")  # fmt: skip

    def guards(self, domain: str) -> Path | None:
        """The allow directory checked for `domain`, if this handler runs and guards it from one."""
        return self._allow.dirs.get(domain) if self._zap is not None else None

    def guarding(self, domain: str) -> bool:
        """Whether this handler runs and checks `domain` (against a directory or a fixed list)."""
        return self._zap is not None and domain in self._allow.keys

    def keys_of(self, domain: str) -> frozenset[bytes]:
        return self._allow.keys.get(domain, frozenset())

    def reload(self) -> dict[str, int]:
        """Re-read every allow directory (after adding or removing keys); on error the old lists stay."""
        fresh = {domain: load_allowed_keys(d) for domain, d in self._allow.dirs.items() if d is not None}
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


def _allow_source(
    allow_dir: str | Path | None, keys: frozenset[bytes] | None
) -> tuple[Path | None, frozenset[bytes]]:
    if (allow_dir is None) == (keys is None):
        raise InternalError("an allow-list comes from an allow directory or a fixed set of keys: give one")
    if allow_dir is not None:
        return Path(allow_dir), load_allowed_keys(allow_dir)
    return None, frozenset(keys)


def authenticator_for(ctx: zmq.Context) -> Authenticator | None:
    with _running_lock:
        return _running.get(ctx.underlying)


def ensure_authenticator(ctx: zmq.Context, server: CurveServer) -> Authenticator:
    """The context's Authenticator (started if needed), guarding `server.domain` with its allow_dir."""
    auth = authenticator_for(ctx)
    if auth is None:
        auth = Authenticator()
        auth.start(ctx, server.allow_dir, domain=server.domain, keys=server.allowed_keys)
    elif not auth.guarding(server.domain):
        auth.allow(server.allow_dir, domain=server.domain, keys=server.allowed_keys)
    elif (current := auth.guards(server.domain)) is not None:
        if server.allow_dir is None or current.resolve() != server.allow_dir.resolve():
            raise ConfigError(f"ZAP domain {server.domain!r} already uses allow directory {current}")
    elif server.allowed_keys != auth.keys_of(server.domain):
        raise ConfigError(f"ZAP domain {server.domain!r} already admits a different list of keys")
    return auth


def _check_unused(sock: zmq.Socket) -> None:
    if sock.getsockopt(zmq.LAST_ENDPOINT):
        raise InternalError("CURVE options must be set before the socket binds or connects")


def apply_server(sock: zmq.Socket, server: CurveServer) -> None:
    """Make `sock` a CURVE server whose clients its context's Authenticator checks. Before bind."""
    _check_unused(sock)
    auth = authenticator_for(sock.context)
    if auth is None or not auth.guarding(server.domain):
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
