import asyncio

import pytest
import pytest_asyncio


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """The tiny random Qwen2-VL checkpoint, written once for the whole session."""
    from epdq.models.tiny import write_tiny_checkpoint

    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("model") / "tiny"))


@pytest.fixture(scope="module")
def encoder(model_dir):
    """The transformers vision tower of the tiny checkpoint (engine tests)."""
    from epdq.engines.vision import HFVisionEncoder

    return HFVisionEncoder(model_dir)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vllm_pd(model_dir):
    """A vLLM engine in PD mode (it takes precomputed image embeddings) on the tiny checkpoint,
    one per test module (a module may reset its caches or poison them on purpose)."""
    from epdq.engines.vllm_engine import VllmEngine

    engine = VllmEngine(model_dir, mode="pd", max_model_len=1024, max_num_seqs=4)
    try:
        await asyncio.wait_for(engine.start(), 180)
        yield engine
    finally:
        await engine.close()
