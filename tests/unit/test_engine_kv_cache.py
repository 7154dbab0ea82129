"""The vLLM engine's context length and KV cache: `epdq worker --max-model-len/--kv-cache-mb`.

Every worker's vLLM got 64 MiB of KV cache and 4096 tokens, with no way to change them. vLLM
refuses to start unless one full sequence fits: a real Qwen2.5-VL-3B needs ~144 MiB at 4096 tokens
in bfloat16, 7B ~224 MiB, so a PD worker on a real model could not start on a GPU. Checked here
without starting vLLM: the settings, what reaches the engine, and the engine arguments."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import epdq.engines.vllm_engine as vllm_engine
import epdq.launch as launch
from cli.main import app
from epdq.errors import ConfigError
from epdq.worker.runner import WorkerConfig, run_worker

pytestmark = pytest.mark.timeout(120)
MiB = 2**20


@pytest.fixture(scope="module")
def tiny_model() -> str:
    from epdq.models.tiny import default_model_dir

    return str(default_model_dir())


# -- the settings ---------------------------------------------------------------------------


def test_defaults_keep_the_cpu_sizes_the_tiny_model_runs_with():
    cfg = WorkerConfig(role="pd", broker="ipc:///x/b.sock")
    assert cfg.max_model_len == 4096 and cfg.kv_cache_bytes == 0  # 0: 64 MiB on the CPU, vLLM's on a GPU


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"max_model_len": 15}, "max_model_len must be in"),
        ({"max_model_len": 2**21}, "max_model_len must be in"),
        ({"kv_cache_bytes": 1000}, "kv_cache_bytes must be 0"),
        ({"kv_cache_bytes": -MiB}, "kv_cache_bytes must be 0"),
        ({"kv_cache_bytes": 2**41}, "kv_cache_bytes must be 0"),
        ({"kv_cache_bytes": 256 * MiB, "role": "encoder"}, "setting of the vLLM engine"),
        ({"kv_cache_bytes": 256 * MiB, "engine": "hf"}, "setting of the vLLM engine"),
        ({"kv_cache_bytes": 256 * MiB, "engine": "noop"}, "setting of the vLLM engine"),
    ],
)
def test_bad_settings_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        WorkerConfig(**{"role": "pd", "broker": "ipc:///x/b.sock", **kw})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-model-len", "8"], "--max-model-len must be in [16, 1048576] tokens, got 8"),
        (["--kv-cache-mb", "-1"], "--kv-cache-mb (in bytes) must be 0 (automatic) or 1 MiB..1 TiB"),
        (["--kv-cache-mb", "64", "--engine", "noop"], "--kv-cache-mb (in bytes) is a setting of the vLLM engine"),
    ],
)
def test_the_cli_refuses_them_naming_the_flag(argv, message, monkeypatch):
    async def must_not_run(cfg):
        raise AssertionError("the worker started")

    monkeypatch.setattr(launch, "serve_worker", must_not_run)
    res = CliRunner().invoke(app, ["worker", "--role", "pd", "--broker", "ipc:///x/b.sock", *argv])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.replace("│", " ").split())


def test_the_cli_hands_them_to_the_worker(monkeypatch):
    got: list[WorkerConfig] = []

    async def serve(cfg):
        got.append(cfg)

    monkeypatch.setattr(launch, "serve_worker", serve)
    argv = ["worker", "--role", "pd", "--broker", "ipc:///x/b.sock", "--max-model-len", "8192", "--kv-cache-mb", "300"]
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 0, res.output
    assert got[0].max_model_len == 8192 and got[0].kv_cache_bytes == 300 * MiB


# -- what reaches the engine -----------------------------------------------------------------


class _Built(Exception):
    pass


@pytest.mark.parametrize(
    ("kw", "expected"),
    [({}, {"max_model_len": 4096, "kv_cache_bytes": None}),
     ({"max_model_len": 8192, "kv_cache_bytes": 300 * MiB}, {"max_model_len": 8192, "kv_cache_bytes": 300 * MiB})],
)  # fmt: skip
async def test_the_pd_worker_passes_them_to_its_vllm_engine(kw, expected, monkeypatch, tiny_model, tmp_path):
    seen: list[dict] = []

    def engine(model, **kwargs):
        seen.append(kwargs)
        raise _Built

    monkeypatch.setattr(vllm_engine, "VllmEngine", engine)
    cfg = WorkerConfig(role="pd", broker=f"ipc://{tmp_path}/b.sock", model=tiny_model, capacity=3, **kw)
    with pytest.raises(_Built):
        await asyncio.wait_for(run_worker(cfg), 60)
    assert {k: seen[0][k] for k in expected} == expected and seen[0]["max_num_seqs"] == 3


# -- the engine's arguments ------------------------------------------------------------------


def _text_config(layers, heads, kv_heads, hidden, **kw):
    return SimpleNamespace(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           hidden_size=hidden, **kw)  # fmt: skip


def test_kv_bytes_per_token_of_real_models():
    # Qwen2.5-VL-3B and -7B (their config.json), bfloat16: what vLLM asks for at 4096 tokens
    assert vllm_engine.kv_bytes_per_token(_text_config(36, 16, 2, 2048), "bfloat16") * 4096 == 144 * MiB
    assert vllm_engine.kv_bytes_per_token(_text_config(28, 28, 4, 3584), "bfloat16") * 4096 == 224 * MiB
    assert vllm_engine.kv_bytes_per_token(_text_config(2, 4, 2, 128, head_dim=64), "float32") == 2 * 2 * 2 * 64 * 4


def test_a_kv_cache_too_small_for_one_sequence_is_refused_before_vllm_starts(tiny_model):
    # the tiny model: 2 layers x 2 KV heads x 32 x float32, keys and values = 1 KiB a token
    with pytest.raises(ConfigError, match=r"cannot hold one sequence of max_model_len=4096 tokens .*at least 4 MiB"):
        vllm_engine.VllmEngine(tiny_model, mode="pd", max_model_len=4096, kv_cache_bytes=2 * MiB)
    vllm_engine.VllmEngine(tiny_model, mode="pd", max_model_len=4096, kv_cache_bytes=4 * MiB)


def test_engine_args_on_the_cpu_and_on_a_gpu(tiny_model):
    auto = vllm_engine.VllmEngine(tiny_model, mode="pd", max_model_len=4096, max_num_seqs=5)
    cpu, gpu = auto.engine_args(on_cpu=True), auto.engine_args(on_cpu=False)
    assert cpu["kv_cache_memory_bytes"] == 64 * MiB  # as before: what the tests and the notes measured
    assert "kv_cache_memory_bytes" not in gpu  # vLLM sizes it from gpu_memory_utilization
    assert cpu["max_model_len"] == gpu["max_model_len"] == 4096 and cpu["max_num_seqs"] == 5
    given = vllm_engine.VllmEngine(tiny_model, mode="both", max_model_len=2048, kv_cache_bytes=300 * MiB)
    assert given.engine_args(on_cpu=True)["kv_cache_memory_bytes"] == 300 * MiB
    assert given.engine_args(on_cpu=False)["kv_cache_memory_bytes"] == 300 * MiB
    # the CPU default is checked too (128 MiB needed); on a GPU vLLM decides
    long = vllm_engine.VllmEngine(tiny_model, mode="pd", max_model_len=2**17)
    with pytest.raises(ConfigError, match="a KV cache of 64 MiB cannot hold"):
        long.engine_args(on_cpu=True)
    assert "kv_cache_memory_bytes" not in long.engine_args(on_cpu=False)


def test_vllm_takes_the_engine_args(tiny_model):
    # imports vLLM (seconds) but starts nothing: every name must be one of AsyncEngineArgs'
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs

    engine = vllm_engine.VllmEngine(tiny_model, mode="pd", max_model_len=1024, kv_cache_bytes=8 * MiB)
    args = AsyncEngineArgs(**engine.engine_args(on_cpu=False))
    assert args.kv_cache_memory_bytes == 8 * MiB and args.max_model_len == 1024
