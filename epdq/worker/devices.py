"""Which device a worker computes on, which embedding ring it writes, and which dtype it uses.

Pure checks on strings; torch is imported only when a CUDA device is asked for, or when a vLLM
engine is about to start (`resolve_vllm_dtype`), so CPU workers (and processes that only build
configs, such as `epdq up`) behave exactly as before.
"""

from __future__ import annotations

import re

RING_KINDS = ("auto", "shm", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICE = re.compile(r"cpu|cuda(?::([0-9]{1,3}))?")


class DeviceUnavailableError(ValueError):
    """The configured device does not exist on this machine (e.g. `--device cuda:0` without CUDA)."""


def parse_device(device: str) -> str:
    """'cpu', 'cuda' or 'cuda:N' -> the canonical form ('cuda' becomes 'cuda:0'); ValueError if malformed."""
    m = _DEVICE.fullmatch(device) if isinstance(device, str) else None
    if m is None:
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    if device == "cpu":
        return "cpu"
    return f"cuda:{int(m.group(1) or 0)}"


def check_device(device: str) -> str:
    """The canonical device, after checking that it exists here; DeviceUnavailableError if not."""
    device = parse_device(device)
    if device == "cpu":
        return device
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a dependency of every engine
        raise DeviceUnavailableError(f"device {device} needs torch with CUDA: {e}") from None
    if not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no visible CUDA device"
        raise DeviceUnavailableError(f"device {device} was asked for, but this machine has {build}")
    index, count = int(device.split(":")[1]), torch.cuda.device_count()
    if index >= count:
        raise DeviceUnavailableError(
            f"device {device} was asked for, but only {count} CUDA device(s) are visible (cuda:0..cuda:{count - 1})"
        )
    return device


def resolve_ring(ring: str, device: str) -> str:
    """The ring an encoder on `device` writes: 'auto' is 'cuda' on a CUDA device, else 'shm'."""
    if ring not in RING_KINDS:
        raise ValueError(f"ring must be one of {RING_KINDS}, got {ring!r}")
    is_cuda = parse_device(device).startswith("cuda")
    if ring == "auto":
        return "cuda" if is_cuda else "shm"
    if ring == "cuda" and not is_cuda:
        raise ValueError(f"ring 'cuda' needs a CUDA device (--device cuda[:N]), not {device!r}")
    return ring


def resolve_dtype(dtype: str, device: str) -> str:
    """'auto' is bfloat16 on a CUDA device and float32 on the CPU; other names pass through."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if dtype == "auto":
        return "bfloat16" if parse_device(device).startswith("cuda") else "float32"
    return dtype


def cuda_visible() -> bool:
    """Whether this process sees a CUDA device. torch counts them through NVML where it can,
    without initialising CUDA here: a vLLM engine started after this may still fork its processes
    (after a CUDA runtime call, CUDA would fail in them)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.device_count() > 0


def resolve_vllm_dtype(dtype: str, device: str) -> str:
    """The dtype of a vLLM engine. vLLM picks its platform itself: `cuda:N` only pins it to one
    GPU, and on `cpu` (the --device default, which places the vision tower and the hf engine) it
    still runs on a GPU whenever this machine has one. So 'auto' follows where vLLM will run:
    bfloat16 on a GPU, as documented, not float32 from the --device default."""
    if dtype == "auto" and parse_device(device) == "cpu" and cuda_visible():
        return resolve_dtype(dtype, "cuda:0")
    return resolve_dtype(dtype, device)
