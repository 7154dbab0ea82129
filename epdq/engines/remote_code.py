"""Install a checkpoint's own Python modules (`auto_map`, trust_remote_code) once, under a lock.

transformers copies such modules into one shared cache (HF_MODULES_CACHE) the first time a
checkpoint is loaded, without any locking. Several processes, or two engines starting in threads,
can then import a half-written copy ("module has no attribute ..."). Once the copy exists and is
identical, transformers only reads it, so doing the first copy under a file lock removes the race.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import threading

_CONFIG_FILES = (
    "config.json", "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
    "tokenizer_config.json",
)  # fmt: skip
_done: set[str] = set()
_lock = threading.Lock()


def _class_refs(model_dir: pathlib.Path) -> list[str]:
    refs: list[str] = []
    for name in _CONFIG_FILES:
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            auto_map = json.loads(path.read_text()).get("auto_map") or {}
        except (OSError, ValueError):
            continue
        for value in auto_map.values():
            for ref in value if isinstance(value, list) else [value]:
                if isinstance(ref, str) and "." in ref and "--" not in ref:  # local modules only
                    refs.append(ref)
    return sorted(set(refs))


def prepare_remote_code(model_dir: str | os.PathLike) -> None:
    model_dir = pathlib.Path(model_dir).absolute()
    key = str(model_dir)
    with _lock:
        if key in _done:
            return
        refs = _class_refs(model_dir)
        if refs:
            # copy only: importing the module here would change what later loads see
            from transformers.dynamic_module_utils import get_cached_module_file
            from transformers.utils import HF_MODULES_CACHE

            os.makedirs(HF_MODULES_CACHE, exist_ok=True)
            with open(os.path.join(HF_MODULES_CACHE, ".epdq-remote-code.lock"), "w") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                try:
                    for ref in refs:
                        get_cached_module_file(key, ref.rsplit(".", 1)[0] + ".py")
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)
        _done.add(key)
