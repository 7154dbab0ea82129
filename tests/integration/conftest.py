import pytest


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
