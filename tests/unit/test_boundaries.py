"""The architecture's import boundaries (DESIGN.md), checked in fresh interpreters."""

import subprocess
import sys

import pytest


def modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "module, forbidden",
    [
        ("epdq.broker", {"torch", "transformers", "vllm", "typer", "cli"}),
        ("epdq.scheduler", {"zmq", "torch", "asyncio"}),
        ("epdq.client", {"torch", "transformers", "vllm", "epdq.worker", "epdq.engines", "typer"}),
        ("epdq", {"torch", "vllm", "typer", "cli"}),
        ("epdq.protocol", {"zmq", "torch"}),
    ],
)
def test_import_boundaries(module, forbidden):
    loaded = modules_after_import(module)
    assert not {m for m in loaded if m.split(".")[0] in forbidden or m in forbidden}


def test_library_never_imports_the_cli():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "epdq"
    offenders = [
        p for p in root.rglob("*.py") if "import typer" in p.read_text() or "from cli" in p.read_text()
    ]
    assert not offenders


def test_the_supported_model_families_are_the_vision_towers_known():
    from epdq.engines import SUPPORTED_MODEL_TYPES
    from epdq.engines.vision import _VISION_CLASSES

    assert set(SUPPORTED_MODEL_TYPES) == set(_VISION_CLASSES)
