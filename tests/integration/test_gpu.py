"""The GPU path end to end: the GPU check's dry run on any machine, the CUDA ring on a GPU.

`test_gpu_check_dry_run` runs `python -m epdq.benchmarks.gpu_check` on the CPU with a reduced
real-shape checkpoint: every stage of the script that `bench/gpu_check.sh` runs on a GPU (hand-off,
checkpoint, cluster, token check, goodput, ring path, summary files), with the shared-memory ring.
The `gpu` tests need a CUDA device and are skipped with that reason elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epdq.cluster import Cluster, ClusterSpec
from epdq.demo import demo_image

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False")


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "epdq.benchmarks.gpu_check", "--device", "cpu", "--layers", "2", "--vision-depth", "1",
        "--small-vocab", "--out", str(out), "--image-size", "112", "--max-tokens", "6", "--goodput-qps", "4",
        "--requests", "3", "--goodput-tokens", "4", "--handoff-sizes", "1", "--handoff-repeats", "2",
        "--handoff-pool-mib", "32", "--work", str(tmp_path / "work"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["gpu_check.json", "handoff.json", "logs.txt", "summary.md"]
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["passed"] and not data["failures"] and data["token_check"]["judged"]
    assert all(s["status"] == "ok" for s in data["stages"].values()), data["stages"]
    assert data["token_check"]["identical"] and len(data["token_check"]["cases"]) == 5
    assert data["ring_path"] == {**data["ring_path"], "expected": "shm", "encoder_ring": "shm", "ok": True}
    assert data["handoff"]["cuda"]["status"] == "skipped: no CUDA" or torch.cuda.is_available()
    assert {p["route"] for p in data["goodput"]["points"]} == {"epd", "colocated"}
    # the diagnostics: float32 on the CPU, the same tower in one forward or one image per forward
    [rounding] = data["vision_rounding"]
    assert rounding["dtype"] == "float32" and rounding["images"] == 2
    assert rounding["encoder_vs_full_model"]["rows"] == rounding["batched_vs_one_per_forward"]["rows"] > 0
    assert data["decode_steps"]["steps"] == 48 and data["decode_steps"]["step_p50_ms"] > 0
    assert data["decode_steps"]["profile"]["top_host_ops"][0]["op"].startswith("aten::")
    costs = data["ring_cuda_costs"]
    assert [w["size_mib"] for w in costs["whole"]] == [1, 32] and costs["whole"][0]["read_pinned_p50_us"] > 0
    assert any(m["op"].startswith("64 B header D2H into pinned") for m in costs["micro"])
    assert "token_check_float32" not in data  # the recheck runs only after a bf16/fp16 difference
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# epdq GPU check: PASSED")
    for title in ("Token check", "Short goodput run", "Embedding hand-off between GPU tensors", "How the PD worker",
                  "Why bf16 outputs can part", "One request alone", "CUDA ring write and read"):
        assert title in summary
    assert "skipped: no CUDA" in summary or torch.cuda.is_available()
    assert "===== pd-0.log" in (out / "logs.txt").read_text()


@pytest.mark.gpu
@needs_gpu
async def test_cuda_ring_end_to_end(tmp_path, model_dir):
    """Encoder and PD worker on one GPU: the PD worker maps the encoder's CUDA ring and reads every
    entry device-to-device; greedy output equals the colocated worker's on the same GPU."""
    spec = ClusterSpec(address=f"ipc://{tmp_path}/broker.sock", encoders=1, pds=1, both=1, model=model_dir,
                       worker_defaults={"engine": "hf", "device": "cuda:0", "dtype": "float32"},
                       log_dir=str(tmp_path / "logs"), start_timeout_s=300)  # fmt: skip
    cluster = Cluster(spec)
    try:
        await cluster.start()
        async with cluster.client(timeout=120) as c:
            for images in ([], [demo_image(1, (112, 112))], [demo_image(2, (160, 96)), demo_image(3, (84, 140))],
                           [demo_image(4, (112, 112))] * 2):  # fmt: skip
                epd = await c.generate("Describe.", images=images, max_tokens=10, route="epd")
                colo = await c.generate("Describe.", images=images, max_tokens=10, route="colocated")
                assert epd.token_ids == colo.token_ids
    finally:
        await asyncio.to_thread(cluster.stop)
    enc = (tmp_path / "logs" / "encoder-0.log").read_text()
    pd = (tmp_path / "logs" / "pd-0.log").read_text()
    assert "ring cuda-" in enc
    assert "mapped CUDA ring" in pd and "fetch socket" not in pd
    cuda, _shm, remote = map(int, re.findall(r"embedding reads: cuda=(\d+) shm=(\d+) remote=(\d+)", pd)[-1])
    assert cuda >= 4 and remote == 0
