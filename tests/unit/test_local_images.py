"""The gateway's `--allow-dir` reader: what it refuses, and that a refusal holds no file open."""

import os

import pytest

from epdq.chat_request import HTTPError, read_local_image


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_refusals_are_400s_and_leave_no_descriptor_open(tmp_path):
    allow = tmp_path / "allowed"
    (allow / "sub").mkdir(parents=True)
    (allow / "cat.png").write_bytes(b"\x89PNG" + bytes(60))
    (allow / "big.png").write_bytes(bytes(101))
    os.mkfifo(allow / "pipe")
    (tmp_path / "secret.png").write_bytes(b"x")
    os.symlink(tmp_path / "secret.png", allow / "escape.png")
    cases = {
        "sub": "not a regular file",  # a directory: os.fdopen used to raise, leaking the fd
        ".": "not a regular file",
        "pipe": "not a regular file",
        "big.png": "larger than 100 bytes",
        "escape.png": "outside the allowed directory",
        "../secret.png": "outside the allowed directory",
        "missing.png": "not found or not readable",
        "": "empty or invalid",
    }
    before = open_fds()
    for _ in range(3):
        for ref, message in cases.items():
            with pytest.raises(HTTPError, match=message) as e:
                read_local_image(ref, str(allow), 100)
            assert e.value.status == 400, ref
    assert open_fds() == before
    assert read_local_image("cat.png", str(allow), 100) == b"\x89PNG" + bytes(60)
    assert open_fds() == before
