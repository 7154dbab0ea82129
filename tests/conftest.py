import atexit
import os
import shutil
import tempfile

# Before anything imports transformers or vLLM: no hub access, caches in a private temp dir.
_CACHE = tempfile.mkdtemp(prefix="epdq-test-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
for _k, _sub in (("HF_HOME", "hf"), ("VLLM_CACHE_ROOT", "vllm-cache"), ("VLLM_CONFIG_ROOT", "vllm-config"),
                 ("EPDQ_HOME", "epdq-home")):  # fmt: skip
    os.environ.setdefault(_k, os.path.join(_CACHE, _sub))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("VLLM_RPC_BASE_PATH", os.path.join(_CACHE, "vllm-rpc"))
os.makedirs(os.environ["VLLM_RPC_BASE_PATH"], mode=0o700, exist_ok=True)
