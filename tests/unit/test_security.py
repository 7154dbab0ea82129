"""Key files, configs and the plaintext policy of epdq.security (no sockets)."""

from __future__ import annotations

import os
import stat

import pytest
import zmq
import zmq.auth

from epdq.errors import ConfigError, InternalError
from epdq.security import (
    CurveClient,
    CurveServer,
    KeyPair,
    SecurityConfig,
    apply_server,
    check_plaintext_allowed,
    curve_required,
    generate_keypair,
    load_allowed_keys,
    load_keypair,
    load_public_key,
    peer_key,
)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture()
def keys(tmp_path):
    return tmp_path / "keys"


def test_generate_writes_private_secret_and_public_key(keys):
    pub, sec = generate_keypair(keys, "broker")
    assert (pub.name, sec.name) == ("broker.key", "broker.key_secret")
    assert _mode(keys) == 0o700
    assert _mode(sec) == 0o600
    assert _mode(pub) == 0o644
    pair = load_keypair(sec)
    assert load_public_key(pub) == pair.public
    assert zmq.curve_public(pair.secret) == pair.public
    # the public file carries no secret; pyzmq's own reader agrees with ours
    assert b"secret-key" not in pub.read_bytes()
    assert zmq.auth.load_certificate(sec) == (pair.public, pair.secret)
    assert zmq.auth.load_certificate(pub) == (pair.public, None)


def test_generate_refuses_overwrite_unless_asked(keys):
    pub, sec = generate_keypair(keys, "w1")
    before = load_keypair(sec)
    with pytest.raises(ConfigError, match="already exists"):
        generate_keypair(keys, "w1")
    assert load_keypair(sec) == before
    generate_keypair(keys, "w1", overwrite=True)
    after = load_keypair(sec)
    assert after.public != before.public
    assert load_public_key(pub) == after.public
    assert _mode(sec) == 0o600
    assert sorted(p.name for p in keys.iterdir()) == ["w1.key", "w1.key_secret"]  # no temp files left


def test_generate_refuses_a_lone_public_file(keys):
    keys.mkdir()
    (keys / "x.key").write_text("planted")
    with pytest.raises(ConfigError, match="already exists"):
        generate_keypair(keys, "x")


@pytest.mark.parametrize("name", ["", "../up", "a/b", ".hidden", "-opt", "x" * 65])
def test_generate_rejects_bad_names(keys, name):
    with pytest.raises(ConfigError):
        generate_keypair(keys, name)


def test_secret_readable_by_others_is_refused(keys):
    _, sec = generate_keypair(keys, "c")
    for mode in (0o644, 0o640, 0o604, 0o660):
        sec.chmod(mode)
        with pytest.raises(ConfigError, match="chmod 600"):
            load_keypair(sec)
    sec.chmod(0o400)
    load_keypair(sec)


def test_load_errors_are_typed(keys, tmp_path):
    pub, sec = generate_keypair(keys, "c")
    with pytest.raises(ConfigError, match="does not exist"):
        load_keypair(keys / "missing.key_secret")
    with pytest.raises(ConfigError, match="no secret-key"):
        load_keypair(pub)  # the public file given where the secret one belongs
    with pytest.raises(ConfigError, match="not a regular file"):
        load_public_key(keys)

    def write_secret(text: str):
        p = tmp_path / "bad.key_secret"
        p.unlink(missing_ok=True)
        p.write_text(text)
        p.chmod(0o600)
        return p

    good = load_keypair(sec)
    other = KeyPair(*zmq.curve_keypair())
    cases = {
        "not a 40-character": f'curve\n    public-key = "{good.public.decode()}"\n    secret-key = "short"\n',
        "does not belong": f'curve\n public-key = "{other.public.decode()}"\n secret-key = "{good.secret.decode()}"\n',
        "more than one": f'public-key = "{good.public.decode()}"\npublic-key = "{good.public.decode()}"\n',
        "no secret-key": "garbage\n\x00\x01",
    }
    for match, text in cases.items():
        with pytest.raises(ConfigError, match=match):
            load_keypair(write_secret(text))
    with pytest.raises(ConfigError, match="too large"):
        load_keypair(write_secret("#" * 70_000))
    with pytest.raises(ConfigError, match="no public-key"):
        load_public_key(write_secret("metadata\n"))


def test_keypair_repr_hides_the_secret():
    pair = KeyPair(*zmq.curve_keypair())
    assert pair.secret.decode() not in repr(pair)
    assert pair.public.decode() in repr(pair)


def test_allow_dir_loading(tmp_path):
    allow = tmp_path / "allow"
    allow.mkdir(mode=0o700)
    assert load_allowed_keys(allow) == frozenset()
    a, _ = generate_keypair(tmp_path / "k", "a")
    (allow / "a.key").write_bytes(a.read_bytes())
    (allow / "notes.txt").write_text("ignored")
    assert load_allowed_keys(allow) == {load_public_key(a)}
    (allow / "broken.key").write_text("public-key = nope\n")
    with pytest.raises(ConfigError, match="z85"):
        load_allowed_keys(allow)  # one bad file fails the load rather than silently shrinking the list
    (allow / "broken.key").unlink()
    allow.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by others"):
        load_allowed_keys(allow)
    with pytest.raises(ConfigError, match="does not exist"):
        load_allowed_keys(tmp_path / "nope")


def test_curve_configs_validate(tmp_path):
    pair = KeyPair(*zmq.curve_keypair())
    with pytest.raises(ConfigError, match="allow directory"):
        CurveServer(pair, tmp_path / "nope")
    with pytest.raises(ConfigError, match="ZAP domain"):
        CurveServer(pair, tmp_path, domain="")
    with pytest.raises(ConfigError, match="server public key"):
        CurveClient(pair, b"x" * 39)
    with pytest.raises(ConfigError, match="does not belong"):
        KeyPair(zmq.curve_keypair()[0], pair.secret)


def test_security_config(tmp_path):
    pub, sec = generate_keypair(tmp_path / "k", "n")
    allow = tmp_path / "allow"
    allow.mkdir()
    with pytest.raises(ConfigError, match="'curve' or 'none'"):
        SecurityConfig(mode="tls")
    with pytest.raises(ConfigError, match="needs secret_key"):
        SecurityConfig(mode="curve")
    with pytest.raises(ConfigError, match="mode is 'none'"):
        SecurityConfig(mode="none", secret_key=sec)
    with pytest.raises(ConfigError, match="does not exist"):
        SecurityConfig(mode="curve", secret_key=tmp_path / "missing")
    with pytest.raises(ConfigError, match="not a directory"):
        SecurityConfig(mode="curve", secret_key=str(sec), allow_dir=str(sec))
    cfg = SecurityConfig(mode="curve", secret_key=str(sec), server_key=str(pub), allow_dir=str(allow))
    assert cfg.secret_key == sec and cfg.allow_dir == allow
    assert cfg.server().keypair == load_keypair(sec)
    assert cfg.client().server_public == load_public_key(pub)
    other = zmq.curve_keypair()[0]
    assert cfg.client(server_public=other).server_public == other
    only_client = SecurityConfig(mode="curve", secret_key=sec, server_key=pub)
    with pytest.raises(ConfigError, match="allow directory"):
        only_client.server()
    with pytest.raises(ConfigError, match="server_key"):
        SecurityConfig(mode="curve", secret_key=sec).client()


NONE = SecurityConfig()
INSECURE = SecurityConfig(mode="none", insecure_ok=True)


@pytest.mark.parametrize(
    "address",
    [
        "tcp://0.0.0.0:7700",
        "tcp://*:7700",
        "tcp://10.1.2.3:7700",
        "tcp://[::]:7700",
        "tcp://eth0:7700",
        "tcp://head-node.example:7700",
        "tcp://127.0.0.1:5;10.0.0.2:7700",
    ],  # fmt: skip
)
def test_non_loopback_tcp_needs_curve_even_when_insecure(address):
    for cfg in (NONE, INSECURE):
        with pytest.raises(ConfigError, match="must use CURVE"):
            check_plaintext_allowed(address, cfg)
        with pytest.raises(ConfigError):
            curve_required(address, cfg)


@pytest.mark.parametrize(
    "address",
    [
        "tcp://127.0.0.1:7700",
        "tcp://127.3.4.5:*",
        "tcp://[::1]:7700",
        "tcp://localhost:7700",
        "tcp://[::ffff:127.0.0.1]:7700",
        "tcp://10.0.0.2:0;127.0.0.1:7700",
    ],  # fmt: skip
)
def test_loopback_plaintext_only_with_explicit_insecure(address):
    with pytest.raises(ConfigError, match="insecure"):
        check_plaintext_allowed(address, NONE)
    check_plaintext_allowed(address, INSECURE)
    assert curve_required(address, INSECURE) is False


def test_ipc_and_inproc_plaintext_ok_and_curve_only_on_tcp(tmp_path):
    pub, sec = generate_keypair(tmp_path / "k", "n")
    curve = SecurityConfig(mode="curve", secret_key=sec, server_key=pub)
    for cfg in (NONE, INSECURE, curve):
        check_plaintext_allowed("ipc:///run/epdq/broker", cfg)
        check_plaintext_allowed("inproc://x", cfg)
        assert curve_required("ipc:///run/epdq/broker", cfg) is False
    assert curve_required("tcp://0.0.0.0:7700", curve) is True
    assert curve_required("tcp://127.0.0.1:7700", curve) is True  # CURVE on loopback too when configured
    with pytest.raises(ConfigError, match="plaintext on .* CURVE keys"):
        check_plaintext_allowed("tcp://127.0.0.1:7700", curve)
    # abstract-namespace ipc has no file permissions: treated like loopback tcp
    assert curve_required("ipc://@epdq-broker", curve) is True
    with pytest.raises(ConfigError, match="insecure"):
        check_plaintext_allowed("ipc://@epdq-broker", NONE)
    assert curve_required("ipc://@epdq-broker", INSECURE) is False
    for bad in ("udp://1.2.3.4:5", "ws://127.0.0.1:80", "127.0.0.1:7700"):
        with pytest.raises(ConfigError, match="unsupported endpoint"):
            curve_required(bad, curve)


def test_apply_server_refuses_a_context_without_authenticator(tmp_path):
    server = CurveServer(KeyPair(*zmq.curve_keypair()), tmp_path)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        with pytest.raises(InternalError, match="admits every client"):
            apply_server(sock, server)
        assert not sock.getsockopt(zmq.CURVE_SERVER)
    finally:
        sock.close(linger=0)
        ctx.term()


def test_peer_key_without_curve_is_none():
    assert peer_key(b"bytes") is None
    assert peer_key(zmq.Frame(b"x")) is None


def test_cluster_keys_refuse_a_public_key_without_its_secret(tmp_path):
    from epdq.keys import ensure_cluster_keys

    d = ensure_cluster_keys(tmp_path / "keys")
    before = (d / "client.key").read_bytes()
    (d / "client.key_secret").unlink()  # lost: a new pair would not match allowed/client.key
    with pytest.raises(ConfigError, match="client.key exists without its secret"):
        ensure_cluster_keys(d)
    assert (d / "client.key").read_bytes() == before
    (d / "client.key").unlink()
    (d / "allowed" / "client.key").unlink()
    ensure_cluster_keys(d)  # removed as the message says: a new pair, trusted again
    assert (d / "allowed" / "client.key").read_bytes() == (d / "client.key").read_bytes() != before
