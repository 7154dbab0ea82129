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

import logging
import os
from pathlib import Path

from epdq.errors import ConfigError
from epdq.security import SecurityConfig, generate_keypair, load_keypair, load_public_key, write_public_key

log = logging.getLogger("epdq.keys")

ROLES = ("broker", "client", "worker")


def default_keys_dir() -> Path:
    home = os.environ.get("EPDQ_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "epdq")
    return Path(home) / "keys"


def ensure_cluster_keys(directory: str | os.PathLike | None = None) -> Path:
    """Create the key pairs and allow-list entries that are missing; never overwrite a key in use.

    - A pair with both files gone is made anew, and its allowed/ entry replaced: removing a pair
      is how a leaked key is rotated, and the old key must stop being admitted.
    - A secret without its public file (a crash between the two writes) gets it back, from the secret.
    - A public file without its secret, a public file that is not its secret's, or an allowed/
      entry that is not its pair's key is a ConfigError naming the files: keygen cannot tell a
      stale copy (the old key, perhaps the leaked one) from a key placed there on purpose, and
      `epdq up` runs this at every start, so it changes nothing it did not make in this run."""
    d = Path(directory) if directory else default_keys_dir()
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    new = set()
    for role in ROLES:
        pub, sec = d / f"{role}.key", d / f"{role}.key_secret"
        if sec.exists():
            key = load_public_key(sec)
            if not (pub.exists() or pub.is_symlink()):
                write_public_key(pub, role, key)
                log.warning("%s was missing: written again from %s", pub, sec.name)
            elif load_public_key(pub) != key:
                raise ConfigError(
                    f"{pub} is not the public key of {sec} (a pair mixed from two copies?): others check "
                    f"this {role} with {pub.name}; remove {pub} to have `epdq keygen {d}` write it again "
                    f"from {sec.name}, or put the matching pair back"
                )
            continue
        if pub.exists() or pub.is_symlink():
            # a new pair would not match what others already trust: the operator decides
            then = "its allowed/ entry is replaced" if role != "broker" else "hand the new broker.key out again"
            raise ConfigError(
                f"{pub} exists without its secret {sec.name}: put the secret key back, or "
                f"remove {pub.name} to make a new pair ({then})"
            )
        generate_keypair(d, role)
        new.add(role)
    allowed = d / "allowed"
    allowed.mkdir(mode=0o700, exist_ok=True)
    for role in ("client", "worker"):
        own, entry = d / f"{role}.key", allowed / f"{role}.key"
        key = load_public_key(own)
        present = entry.exists() or entry.is_symlink()
        if role in new or not present:
            write_public_key(entry, role, key)
            if present:
                log.warning("%s now admits the new %s; the key it held before is no longer admitted", entry, own.name)
        elif load_public_key(entry) != key:
            raise ConfigError(
                f"{entry} admits a different key than {own}: the broker refuses {role}s that use "
                f"{own.name}'s pair and admits whoever holds the other key. To admit {own.name} (e.g. "
                f"after replacing a leaked key), remove {entry} and run `epdq keygen {d}` again; a "
                f"further {role} key to admit goes in allowed/ under another name ({role}-NAME.key)"
            )
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
