"""`keep_large_buffers`: large messages reuse the process's heap instead of fresh mappings."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's thresholds are glibc's")

_PROBE = """
import resource, sys
from epdq.launch import keep_large_buffers
if sys.argv[1] == "keep":
    keep_large_buffers()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):  # the first round may grow the heap
    frames = [b"\x01" * (4 << 20) for _ in range(8)]  # a 32 MiB fetch answer, as it arrives (written)
    del frames
    whole = b"\x01" * (32 << 20)
    del whole
f0 = faults()
for _ in range(3):
    frames = [b"\x01" * (4 << 20) for _ in range(8)]
    del frames
    whole = b"\x01" * (32 << 20)
    del whole
print(faults() - f0)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout.strip())


def test_large_buffers_are_reused_not_mapped_and_faulted_in_again():
    # 3 x 64 MiB allocated and freed: 49,152 pages that glibc's defaults fault in afresh each time
    assert _faults("default") > 20_000
    assert _faults("keep") < 500
