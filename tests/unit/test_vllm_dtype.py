"""`--dtype auto` for a vLLM PD worker follows where vLLM runs, not the --device default.

vLLM picks its platform itself: a PD worker started without --device (deploy/compose.gpu.yaml,
the k8s GPU patch and epdq-pd@.service did so) still ran vLLM on the GPU, but 'auto' was resolved
from --device's default, cpu, so vLLM got float32 where --help and the README promise bf16. No GPU
here: torch's view of CUDA is replaced, and the engine is replaced before vLLM would start."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

import epdq.engines.vllm_engine as vllm_engine
from epdq.worker.devices import resolve_vllm_dtype
from epdq.worker.runner import WorkerConfig, run_worker

pytestmark = pytest.mark.timeout(120)


class _Built(Exception):
    pass


def _cuda(monkeypatch, count: int) -> None:
    # both of torch's ways to ask; neither may initialise CUDA for real here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.fixture(scope="module")
def tiny_model() -> str:
    from epdq.models.tiny import default_model_dir

    return str(default_model_dir())


@pytest.mark.parametrize(("gpus", "expected"), [(1, "bfloat16"), (0, "float32")])
async def test_a_pd_worker_without_device_gives_vllm_the_dtype_of_where_it_runs(
    gpus, expected, monkeypatch, tiny_model, tmp_path
):
    seen: list[dict] = []

    def engine(model, **kwargs):
        seen.append(kwargs)
        raise _Built

    _cuda(monkeypatch, gpus)
    monkeypatch.setattr(vllm_engine, "VllmEngine", engine)
    cfg = WorkerConfig(role="pd", broker=f"ipc://{tmp_path}/b.sock", model=tiny_model)
    # as `epdq up` hands it to the worker process: 'auto' must survive, not arrive as float32
    cfg = msgspec.json.decode(msgspec.json.encode(cfg), type=WorkerConfig)
    with pytest.raises(_Built):
        await asyncio.wait_for(run_worker(cfg), 60)
    assert seen[0]["dtype"] == expected


def test_resolution(monkeypatch):
    _cuda(monkeypatch, 1)
    assert resolve_vllm_dtype("auto", "cpu") == "bfloat16"
    assert resolve_vllm_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_vllm_dtype("float32", "cpu") == "float32"  # an explicit dtype is kept
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_vllm_dtype("fp8", "cpu")
    _cuda(monkeypatch, 0)
    assert resolve_vllm_dtype("auto", "cpu") == "float32"


def test_only_vllm_on_the_default_device_defers_auto(monkeypatch):
    _cuda(monkeypatch, 1)
    broker = "ipc:///x/b.sock"
    assert WorkerConfig(role="pd", broker=broker).dtype == "auto"
    assert WorkerConfig(role="both", broker=broker).dtype == "auto"
    # what runs on --device itself resolves at once, as before
    assert WorkerConfig(role="pd", broker=broker, engine="hf").dtype == "float32"
    assert WorkerConfig(role="encoder", broker=broker).dtype == "float32"
    assert WorkerConfig(role="pd", broker=broker, dtype="float16").dtype == "float16"
    with pytest.raises(ValueError, match="dtype must be"):
        WorkerConfig(role="pd", broker=broker, dtype="fp8")
