"""Why EPD and colocated outputs part in bf16, and what one decode step costs (the GPU check's
diagnostics, run in the check's own process once the cluster has stopped).

Two questions the token check and the goodput run leave open on a GPU:

1. **Rounding or a fault?** The encoder encodes whichever images are queued in one forward; the
   colocated worker encodes a prompt's images in one forward. In bf16 the same image's rows can
   then differ in their last bits (a matrix product over more rows may take another kernel), and
   a random-weight model's greedy choice can turn on such a bit. `vision_rounding` encodes the same
   images three ways with the same weights: the encoder's tower with all images in one forward,
   the same tower one image per forward, and the full model's own `get_image_features` (what the
   colocated worker runs); it reports, per dtype, whether the rows are bit-identical and the
   largest difference.
2. **Engine or contention?** `decode_steps` times single-request decode steps of the transformers
   PD engine with nothing else running (GPU-synchronised), to set against the goodput run's TPOT.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _free(device: str) -> None:
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _compare(a, b) -> dict[str, Any]:
    import torch

    a, b = a.float(), b.float()
    if a.shape != b.shape:
        return {"identical": False, "max_abs": None, "rows_differing": None, "shape": [list(a.shape), list(b.shape)]}
    diff = (a - b).abs()
    return {"identical": bool(torch.equal(a, b)), "max_abs": float(diff.max()) if diff.numel() else 0.0,
            "rows_differing": int((diff > 0).any(dim=1).sum()), "rows": int(a.shape[0]),
            "scale": float(a.abs().max()) if a.numel() else 0.0}  # fmt: skip


def vision_rounding(model_dir: Path, device: str, dtypes: Sequence[str], images: list[bytes]) -> list[dict[str, Any]]:
    """Per dtype: encoder tower (all images in one forward) against the same tower one image per
    forward, and against the full model's `get_image_features` over all images (the colocated path)."""
    import torch

    from epdq.engines.hf_pd import HFPDEngine
    from epdq.engines.vision import HFVisionEncoder
    from epdq.media import decode_image

    pil = [decode_image(b) for b in images]
    out = []
    for dtype in dtypes:
        enc = HFVisionEncoder(model_dir, dtype=dtype, device=device, output_device=device)
        together = torch.cat([e.embeds for e in enc.encode(pil)])
        alone = torch.cat([enc.encode([im])[0].embeds for im in pil])
        del enc
        _free(device)
        eng = HFPDEngine(model_dir, mode="both", dtype=dtype, device=device, max_images_per_prompt=len(pil))
        eng._load()
        full, _grid = eng._encode_images("diagnostic", pil)
        del eng
        _free(device)
        out.append({"dtype": dtype, "images": len(pil),
                    "batched_vs_one_per_forward": _compare(together, alone),
                    "encoder_vs_full_model": _compare(together, full.to(together.device))})  # fmt: skip
        del together, alone, full
        _free(device)
    return out


def decode_steps(model_dir: Path, device: str, dtype: str, steps: int = 48, prompt_words: int = 40,
                 profile_steps: int = 6) -> dict[str, Any]:
    """Single-request decode steps of the transformers PD engine, each timed to its result."""
    import torch

    from epdq.engines.hf_pd import HFPDEngine

    eng = HFPDEngine(model_dir, mode="pd", dtype=dtype, device=device)
    eng._load()
    try:
        prompt = " ".join(f"word{i}" for i in range(prompt_words))
        t = time.perf_counter()
        state = eng._prefill("diagnostic", prompt, None, None)
        token = int(torch.argmax(state["logits"]))
        prefill_ms = (time.perf_counter() - t) * 1e3
        times = []
        for i in range(steps):
            t = time.perf_counter()
            logits = eng._step(state, token, state["prompt_len"] + i)
            token = int(torch.argmax(logits))  # waits for the step, as the engine's sampler does
            times.append((time.perf_counter() - t) * 1e3)
        warm = times[2:] or times
        index = state["prompt_len"] + steps
        profile = _profile_steps(eng, state, token, index, device, n=profile_steps)
        out = {"dtype": dtype, "prompt_tokens": state["prompt_len"], "steps": steps, "prefill_ms": prefill_ms,
               "step_p50_ms": statistics.median(warm), "step_min_ms": min(warm), "step_max_ms": max(warm),
               "profile": profile}  # fmt: skip
        if device.startswith("cuda"):
            # side by side: the same engine with PyTorch's own SDPA choice (cuDNN allowed), what it ran before
            index += profile_steps
            own = eng._decoder_attention
            eng._decoder_attention = contextlib.nullcontext
            try:
                default = []
                for i in range(steps // 2):
                    t = time.perf_counter()
                    token = int(torch.argmax(eng._step(state, token, index + i)))
                    default.append((time.perf_counter() - t) * 1e3)
            finally:
                eng._decoder_attention = own
            out["default_sdpa_step_p50_ms"] = statistics.median(default[2:] or default)
        return out
    finally:
        del eng
        _free(device)


def _profile_steps(eng, state: dict, token: int, index: int, device: str, n: int, top: int = 10) -> dict[str, Any]:
    """torch.profiler over `n` more steps: launches and the ops with the most host time, per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if n <= 0:
        return {}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        for i in range(n):
            token = int(torch.argmax(eng._step(state, token, index + i)))
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    ops = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: e.self_cpu_time_total, reverse=True)
    device_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events if e.key.startswith("aten::"))
    return {"steps": n, "kernel_launches_per_step": launches / n, "device_ms_per_step": device_us / n / 1e3,
            "top_host_ops": [{"op": e.key, "calls_per_step": e.count / n, "self_host_ms_per_step": e.self_cpu_time_total / n / 1e3}
                             for e in ops[:top]]}  # fmt: skip


def render(rounding: list[dict[str, Any]], steps: dict[str, Any] | None) -> list[tuple[str, list[str], list[tuple]]]:
    """(title, headers, rows) of the two diagnostic tables."""
    rows = []
    for r in rounding:
        for name, key in (("encoder tower: all images in one forward vs one per forward", "batched_vs_one_per_forward"),
                          ("encoder tower vs the full model's get_image_features (colocated)", "encoder_vs_full_model")):  # fmt: skip
            c = r[key]
            rows.append((r["dtype"], name, "yes" if c["identical"] else "no",
                         f"{c['rows_differing']}/{c.get('rows', '?')}" if c["rows_differing"] is not None else "shape differs",
                         f"{c['max_abs']:.2g}" if c["max_abs"] is not None else "n/a", f"{c.get('scale', 0):.3g}"))  # fmt: skip
    tables = [(f"Why bf16 outputs can part: the same {rounding[0]['images'] if rounding else 0} images encoded "
               "three ways, same weights (rows = image embedding rows)",
               ["dtype", "comparison", "bit-identical", "rows differing", "max |diff|", "max |value|"], rows)]  # fmt: skip
    if steps:
        tables.append(("One request alone on the transformers PD engine (no other load; each step timed to its token)",
                       ["dtype", "prompt tokens", "prefill ms", "decode step p50 ms", "min ms", "max ms"],
                       [(steps["dtype"], steps["prompt_tokens"], steps["prefill_ms"], steps["step_p50_ms"],
                         steps["step_min_ms"], steps["step_max_ms"])]))  # fmt: skip
        if "default_sdpa_step_p50_ms" in steps:
            tables[-1][2].append((f"{steps['dtype']}, PyTorch's default SDPA (cuDNN allowed)", steps["prompt_tokens"],
                                  "", steps["default_sdpa_step_p50_ms"], "", ""))  # fmt: skip
        prof = steps.get("profile") or {}
        if prof.get("top_host_ops"):
            tables.append((f"Where a decode step's host time goes (torch.profiler, {prof['steps']} steps; "
                           f"{prof['kernel_launches_per_step']:.0f} kernel launches and "
                           f"{prof['device_ms_per_step']:.2f} ms of device time per step)",
                           ["op", "calls per step", "self host ms per step"],
                           [(o["op"], o["calls_per_step"], o["self_host_ms_per_step"]) for o in prof["top_host_ops"]]))  # fmt: skip
    return tables
