"""epdq.keys.security_for: which files each role needs, and what it says when one is missing (no sockets)."""

from __future__ import annotations

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
