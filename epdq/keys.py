"""Where a cluster's CURVE keys live, and which security a process gets by default.

A keys directory holds one key pair per kind of peer and the broker's allow-list:

    broker.key / broker.key_secret     the broker's (clients and workers pin broker.key)
    client.key / client.key_secret     what clients authenticate with
    worker.key / worker.key_secret     what workers authenticate with (and encoders serve fetches with)
    allowed/client.key, allowed/worker.key   the broker's allow-list (only the broker reads it);
                                             only allowed/worker*.key may register workers

A worker needs only worker.key_secret and broker.key: an encoder's fetch socket admits the worker
key pair itself, which is what PD workers connect with. Problems with any of these files are
settings of the process, so they are `ConfigError`s.

`epdq keygen` writes one, and `epdq up` makes `$EPDQ_HOME/keys` on first use, so that tcp links
are encrypted and authenticated by default. Plaintext tcp is possible only when explicitly asked
for, and only on loopback; ipc:// needs no keys (its directory is private to the user).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from epdq.errors import ConfigError
from epdq.security import SecurityConfig, generate_keypair, load_keypair

ROLES = ("broker", "client", "worker")


def default_keys_dir() -> Path:
    home = os.environ.get("EPDQ_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "epdq")
    return Path(home) / "keys"


def ensure_cluster_keys(directory: str | os.PathLike | None = None) -> Path:
    """Create the key pairs and allow-list that are missing; never overwrite existing keys."""
    d = Path(directory) if directory else default_keys_dir()
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    for role in ROLES:
        if not (d / f"{role}.key_secret").exists():
            if (d / f"{role}.key").exists() or (d / f"{role}.key").is_symlink():
                # a new pair would not match what others already trust: the operator decides
                raise ConfigError(
                    f"{d / role}.key exists without its secret {role}.key_secret: put the secret key back, or "
                    f"remove {role}.key (and allowed/{role}.key) to make a new pair"
                )
            generate_keypair(d, role)
    allowed = d / "allowed"
    allowed.mkdir(mode=0o700, exist_ok=True)
    for role in ("client", "worker"):
        if not (allowed / f"{role}.key").exists():
            shutil.copyfile(d / f"{role}.key", allowed / f"{role}.key")
            os.chmod(allowed / f"{role}.key", 0o644)
    return d


def security_for(role: str, *, keys_dir: str = "", insecure: bool = False) -> SecurityConfig:
    """The security of one process: CURVE from `keys_dir` (or the default one if it exists),
    plaintext where explicitly asked for, else a config that only admits ipc://."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    if insecure:
        if keys_dir:
            raise ConfigError("--insecure and --keys-dir exclude each other: plaintext or CURVE, pick one")
        return SecurityConfig(mode="none", insecure_ok=True)
    d = Path(keys_dir) if keys_dir else default_keys_dir()
    if not (d / f"{role}.key_secret").is_file():
        if keys_dir:
            raise ConfigError(f"{d} has no {role}.key_secret: pass --keys-dir with the cluster's keys directory, "
                              f"or run `epdq keygen {d}` to make one")  # fmt: skip
        return SecurityConfig(keys_dir=d)  # ipc only; tcp gets a clear error when the socket is made
    if role == "broker":
        allow = d / "allowed"
        if not allow.is_dir():
            raise ConfigError(f"{allow} does not exist: the broker admits only the public keys in it; run "
                              f"`epdq keygen {d}` to add it (existing keys are kept), or pass --keys-dir with "
                              "the cluster's keys directory")  # fmt: skip
        return SecurityConfig(mode="curve", secret_key=d / "broker.key_secret", allow_dir=allow, keys_dir=d)
    if not (d / "broker.key").is_file():
        raise ConfigError(f"{d} has no broker.key (the broker's public key, which this {role} checks the broker "
                          "with): copy it from the broker's keys directory, or pass --keys-dir with "
                          "the cluster's keys directory")  # fmt: skip
    # a worker's only server socket (an encoder's fetch socket) admits the worker key pair: no allow-list
    return SecurityConfig(mode="curve", secret_key=d / f"{role}.key_secret", server_key=d / "broker.key",
                          admit_own_key=role == "worker", keys_dir=d)  # fmt: skip


def own_public_key(config: SecurityConfig) -> bytes | None:
    """The public key of this process (encoders serve fetches with it; PD workers pin it)."""
    return load_keypair(config.secret_key).public if config.mode == "curve" and config.secret_key else None
