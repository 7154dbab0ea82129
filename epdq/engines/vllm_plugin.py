"""vLLM general plugin: let vLLM's Qwen2-VL code import where torchvision is absent.

vLLM's qwen2_vl (and qwen3_vl) modules do
`from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize`, and that
transformers module imports torchvision at the top. The PIL twin `image_processing_pil_qwen2_vl`
has the same `smart_resize`. An import hook serves the PIL twin's contents under the torchvision
module's name.

vLLM imports models in processes it spawns (model inspection, EngineCore, workers); they do not
inherit a hook installed in the parent. vLLM calls every `vllm.general_plugins` entry point in each
of its processes before it touches a model, so `register()` (declared in pyproject.toml) is the
way in. Nothing is installed when torchvision is importable.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

_TARGET = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_SOURCE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


class _PilQwen2VLFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves the torchvision-backed Qwen2-VL image-processing module to its PIL twin."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin=f"epdq alias of {_SOURCE}")

    def create_module(self, spec):
        return None  # the default module object is fine

    def exec_module(self, module: types.ModuleType) -> None:
        source = importlib.import_module(_SOURCE)
        for name, value in vars(source).items():
            if not name.startswith("__"):
                setattr(module, name, value)
        # The torchvision class name, as transformers itself falls back to without torchvision.
        module.Qwen2VLImageProcessor = source.Qwen2VLImageProcessorPil


def torchvision_available() -> bool:
    return importlib.util.find_spec("torchvision") is not None


def install() -> bool:
    """Install the import hook in this process; True if it is (now) active. Idempotent."""
    if torchvision_available():
        return False
    if not any(isinstance(f, _PilQwen2VLFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PilQwen2VLFinder())
    return True


_watching = False


def _gone(pid: int) -> bool:
    """Exited, or a zombie its parent has not reaped yet (its children were reparented already)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def watch_parent(interval_s: float = 1.0, *, preparing: bool = False) -> bool:
    """In a process vLLM spawned for an epdq worker: exit when that worker is gone.

    A SIGKILLed worker cannot stop its EngineCore; without this the core runs on as an orphan
    holding ~1 GB. Only where the worker asked for it (EPDQ_DIE_WITH_PARENT=1) and only in spawned
    children, never in the worker itself. `preparing`: called while multiprocessing prepares a
    spawned child (see `epdq._watch_parent_early`), before it knows its parent process.
    """
    global _watching
    import multiprocessing
    import os
    import signal
    import threading
    import time

    if _watching or os.environ.get("EPDQ_DIE_WITH_PARENT") != "1":
        return False
    if not preparing and multiprocessing.parent_process() is None:
        return False
    parent = os.getppid()
    worker = os.environ.get("EPDQ_WORKER_PID", "")
    # A worker killed while this child started has handed it to init already, so getppid()
    # names init, which never goes. A child of the worker's own children (vLLM's workers under
    # its EngineCore) has a live worker and watches its own parent.
    orphaned = worker.isdigit() and int(worker) != parent and _gone(int(worker))

    def loop() -> None:
        while not orphaned and os.getppid() == parent:
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGTERM)  # let vLLM clean up its shared memory
        time.sleep(10)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=loop, name="epdq-parent-watch", daemon=True).start()
    _watching = True
    return True


def register() -> None:
    """Entry point of the `vllm.general_plugins` group (called by vLLM in each of its processes)."""
    install()
    watch_parent()
