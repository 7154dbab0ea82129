"""The GPU check's verdict on the token check: judged in float32, only reported in bf16/fp16."""

from __future__ import annotations

import argparse
import contextlib
from types import SimpleNamespace

from epdq.benchmarks import gpu_check as G


class _Client:
    def __init__(self, differ: set[str]):
        self.differ = differ

    async def generate(self, prompt, images, max_tokens, route):
        tokens = [1, 2, 3, 4]
        if route == "epd" and any(name in prompt for name in self.differ):
            tokens = [1, 2, 9, 9]
        return SimpleNamespace(token_ids=tokens, timings=SimpleNamespace(ttft_s=0.01, encode_s=0.002))

    async def stats(self):
        return {"counters": {"requests_completed": 10}}


class _Cluster:
    def __init__(self, differ: set[str]):
        self.differ = differ

    @contextlib.asynccontextmanager
    async def client(self, timeout):
        yield _Client(self.differ)


def _check(tmp_path) -> G.Check:
    args = argparse.Namespace(image_size=32, max_tokens=4, out=str(tmp_path))
    return G.Check(args)


async def test_a_bf16_difference_is_reported_with_where_outputs_part_not_judged(tmp_path):
    chk = _check(tmp_path)
    res = await G._token_check(chk, _Cluster({"two images"}), "bfloat16", judged=False)
    assert not res["identical"] and not res["judged"] and chk.failures == []
    [case] = [c for c in res["cases"] if c["case"] == "two images"]
    assert case["first_difference"] == 2
    assert "NO, from token 2" in chk.tables[-1] and "reported, judged in float32" in chk.tables[-1]


async def test_a_float32_difference_fails_the_check(tmp_path):
    chk = _check(tmp_path)
    res = await G._token_check(chk, _Cluster({"four images"}), "float32", judged=True)
    assert not res["identical"] and chk.failures == ["token check (float32): EPD output differs from the colocated worker's"]
    ok = await G._token_check(_check(tmp_path), _Cluster(set()), "float32", judged=True)
    assert ok["identical"] and all(c["first_difference"] is None for c in ok["cases"])


def test_first_difference():
    assert G._first_difference([1, 2, 3], [1, 2, 3]) is None
    assert G._first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert G._first_difference([1, 2], [1, 2, 3]) == 2  # one stopped early
