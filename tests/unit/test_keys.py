"""epdq.keys.security_for: which files each role needs, and what it says when one is missing (no sockets)."""

from __future__ import annotations

import os
import shutil

import pytest

from epdq.errors import ConfigError
from epdq.keys import ensure_cluster_keys, security_for
from epdq.security import check_plaintext_allowed, load_keypair


@pytest.fixture()
def cluster(tmp_path):
    return ensure_cluster_keys(tmp_path / "cluster")


def handout(cluster, dest, *names):
    """A keys directory holding only `names`, copied as an operator would."""
    dest.mkdir(mode=0o700)
    for name in names:
        shutil.copy2(cluster / name, dest / name)
    return dest


def test_a_worker_needs_only_its_key_pair_and_the_brokers_public_key(cluster, tmp_path):
    """What `epdq keygen` says to give workers; security_for used to demand allowed/ too."""
    d = handout(cluster, tmp_path / "worker", "worker.key_secret", "broker.key")
    cfg = security_for("worker", keys_dir=str(d))
    assert cfg.mode == "curve" and cfg.allow_dir is None
    own = load_keypair(d / "worker.key_secret").public
    assert cfg.client().server_public == load_keypair(cluster / "broker.key_secret").public
    # an encoder's fetch socket admits exactly the worker key pair PD workers connect with
    server = cfg.server()
    assert server.allow_dir is None and server.allowed_keys == {own}
    assert server.domain != "epdq"  # apart from a broker's allow-list in the same process


def test_a_worker_ignores_allowed_which_is_the_brokers(cluster):
    server = security_for("worker", keys_dir=str(cluster)).server()
    assert server.allowed_keys == {load_keypair(cluster / "worker.key_secret").public}  # not client.key


def test_a_broker_without_its_allow_list_says_how_to_make_one(cluster, tmp_path):
    d = handout(cluster, tmp_path / "broker", "broker.key_secret", "broker.key")
    with pytest.raises(ConfigError) as e:
        security_for("broker", keys_dir=str(d))
    assert f"{d}/allowed does not exist" in e.value.message
    assert "`epdq keygen" in e.value.message and "--keys-dir" in e.value.message
    assert "allow_dir" not in e.value.message


@pytest.mark.parametrize("role", ["client", "worker"])
def test_missing_broker_key_is_named(cluster, tmp_path, role):
    d = handout(cluster, tmp_path / role, f"{role}.key_secret")
    with pytest.raises(ConfigError, match=r"has no broker\.key .*--keys-dir") as e:
        security_for(role, keys_dir=str(d))
    assert "server_key" not in e.value.message


def test_keys_dir_errors_are_config_errors_in_flag_terms(cluster, tmp_path):
    with pytest.raises(ConfigError, match=r"has no client\.key_secret: pass --keys-dir .*`epdq keygen"):
        security_for("client", keys_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="--insecure and --keys-dir exclude each other"):
        security_for("client", keys_dir=str(cluster), insecure=True)
    with pytest.raises(ValueError, match="role"):
        security_for("gateway")


def test_plaintext_refusals_say_which_flags_to_use(tmp_path, monkeypatch):
    """A new user's first `epdq broker --address tcp://127.0.0.1:...`: it used to be 'invalid_input'
    naming 'the explicit insecure option', neither the flag nor where keys come from."""
    monkeypatch.setenv("EPDQ_HOME", str(tmp_path / "home"))
    cfg = security_for("broker")
    assert cfg.mode == "none"
    with pytest.raises(ConfigError) as e:
        check_plaintext_allowed("tcp://127.0.0.1:7700", cfg)
    for said in ("--insecure", "`epdq keygen`", "--keys-dir", str(tmp_path / "home" / "keys"), "ipc://"):
        assert said in e.value.message
    with pytest.raises(ConfigError) as e:  # `epdq broker --address tcp://0.0.0.0:7841 --insecure`
        check_plaintext_allowed("tcp://0.0.0.0:7841", security_for("broker", insecure=True))
    assert "not a loopback address" in e.value.message and "only on loopback" in e.value.message
    assert "`epdq keygen`" in e.value.message and "--keys-dir" in e.value.message
    assert "security mode" not in e.value.message


def test_bad_key_files_are_config_errors(cluster):
    (cluster / "worker.key_secret").chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        security_for("worker", keys_dir=str(cluster)).client()
    (cluster / "allowed").chmod(0o777)
    with pytest.raises(ConfigError, match="chmod go-w"):
        from epdq.security import load_allowed_keys

        load_allowed_keys(security_for("broker", keys_dir=str(cluster)).allow_dir)


# -- `epdq keygen` on an existing directory: rotation, a half-written pair, stale allow-list entries


def _public(path):
    from epdq.security import load_public_key

    return load_public_key(path)


def test_a_removed_pair_is_rotated_in_the_allow_list_too(cluster):
    """Removing a leaked pair and running keygen again: the new pair was written, but allowed/ kept
    the old key (copied only when missing), so the leaked key was still admitted and new workers
    refused, with exit 0."""
    from epdq.security import load_allowed_keys, load_worker_keys

    old = _public(cluster / "worker.key")
    (cluster / "worker.key").unlink()
    (cluster / "worker.key_secret").unlink()
    ensure_cluster_keys(cluster)
    new = _public(cluster / "worker.key")
    assert new != old and _public(cluster / "worker.key_secret") == new
    assert _public(cluster / "allowed" / "worker.key") == new
    assert old not in load_allowed_keys(cluster / "allowed") and load_worker_keys(cluster / "allowed") == {new}
    assert _public(cluster / "allowed" / "client.key") == _public(cluster / "client.key")  # untouched


def test_a_stale_allow_list_entry_is_refused_naming_both_files(cluster):
    # what the old keygen left behind: a rotated pair, the old key still in allowed/
    stale = (cluster / "allowed" / "worker.key").read_bytes()
    (cluster / "worker.key").unlink()
    (cluster / "worker.key_secret").unlink()
    ensure_cluster_keys(cluster)
    (cluster / "allowed" / "worker.key").write_bytes(stale)
    with pytest.raises(ConfigError) as e:
        ensure_cluster_keys(cluster)
    assert f"{cluster}/allowed/worker.key admits a different key than {cluster}/worker.key" in e.value.message
    assert f"remove {cluster}/allowed/worker.key" in e.value.message
    assert (cluster / "allowed" / "worker.key").read_bytes() == stale  # nothing changed behind the operator's back
    (cluster / "allowed" / "worker.key").unlink()  # as the message says
    ensure_cluster_keys(cluster)
    assert _public(cluster / "allowed" / "worker.key") == _public(cluster / "worker.key")


def test_a_public_file_lost_between_the_two_writes_is_rebuilt_from_the_secret(tmp_path, monkeypatch):
    """A crash after worker.key_secret was written and before worker.key: every later keygen (and
    `epdq up`) failed with a bare 'No such file or directory'."""
    import epdq.security as security

    class Crash(BaseException):  # the process dies here: nothing after it runs
        pass

    real_replace, calls = os.replace, []

    def crash_on_the_public_file(src, dst):
        calls.append(str(dst))
        if str(dst).endswith("worker.key"):
            raise Crash
        real_replace(src, dst)

    monkeypatch.setattr(security.os, "replace", crash_on_the_public_file)
    with pytest.raises(Crash):
        ensure_cluster_keys(tmp_path / "k")
    monkeypatch.setattr(security.os, "replace", real_replace)
    d = tmp_path / "k"
    assert (d / "worker.key_secret").exists() and not (d / "worker.key").exists()
    secret_public = _public(d / "worker.key_secret")
    ensure_cluster_keys(d)
    assert _public(d / "worker.key") == _public(d / "allowed" / "worker.key") == secret_public
    assert (d / "worker.key").stat().st_mode & 0o777 == 0o644
    assert [p.name for p in d.iterdir() if p.name.startswith(".")] == []  # the failed write's temp file is gone


def test_a_public_file_that_is_not_its_secrets_is_refused(cluster):
    shutil.copy2(cluster / "client.key", cluster / "worker.key")
    with pytest.raises(ConfigError, match=r"worker\.key is not the public key of .*worker\.key_secret"):
        ensure_cluster_keys(cluster)


def test_keygen_twice_changes_nothing(cluster):
    before = {p: p.read_bytes() for p in cluster.rglob("*") if p.is_file()}
    ensure_cluster_keys(cluster)
    assert {p: p.read_bytes() for p in cluster.rglob("*") if p.is_file()} == before
