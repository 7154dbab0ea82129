"""The GPU check: real shapes, one GPU, one command (`bash bench/gpu_check.sh`, under 8 minutes).

Stages, each timed, each allowed to fail without hiding the others' results:

1. **hand-off**: `epdq.benchmarks.handoff` with its GPU rows (CUDA ring vs shm ring vs the
   safetensors-file path vs one device-to-device copy) and the CPU rows;
2. **checkpoint**: random weights with the real shapes of Qwen2.5-VL-3B (or 7B), drawn on the GPU
   (`epdq.models.real_shape`);
3. **cluster**: broker + 1 encoder + 1 PD worker + 1 colocated worker, transformers engines, on
   the one GPU (`--engine hf --device cuda:N`; the encoder's ring is then a CUDA ring);
4. **token check**: greedy output through encoder -> CUDA ring -> PD against the colocated worker
   fed pixels (the same model), for text only, 1, 2 and 4 images and a repeated image; in the
   GPU's dtype (bf16) it is reported with the token where the outputs part, and judged in float32
   (stage 7): in bf16 an image's rows depend on how many images share its vision forward (the
   encoder batches whatever is queued and caches each image once; the colocated worker encodes a
   prompt's images together), so even two colocated runs need not agree token for token;
5. **goodput**: a short Poisson run per offered load on route epd and route colocated;
6. **ring path**: from the PD worker's log: entries were read device-to-device, none fetched;
7. **float32 token check**: the token check again on a fresh cluster in float32 from the same
   checkpoint: every case must be token-identical;
8. **diagnostics** (`epdq.benchmarks.gpu_diag`): the "two images" case's images encoded by the
   encoder's tower in one forward, one per forward, and by the full model (the colocated path), in
   the GPU's dtype and float32, compared bit by bit (the encoder's tower must equal the full
   model's at equal grouping, in every dtype); single-request decode steps timed alone.

Writes under `--out` (flat, at most 8 files): summary.md (every table), gpu_check.json,
handoff.json, logs.txt (tails of the workers' logs). Exit status 0 only when the float32 token
check (the token check itself on a float32 run) was identical in every case, the encoder's tower
equalled the full model's bit for bit, and the PD worker read through the ring the device calls for.

`--device cpu` (with a reduced preset: `--layers 2 --vision-depth 1 --small-vocab`) runs the same
stages on a CPU machine with the shared-memory ring: the dry run the tests use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from epdq.benchmarks.goodput_real import goodput_rps, measure_point
from epdq.benchmarks.report import environment, table

TTFT_SLO_S = 20.0  # vLLM's disaggregated-encoder evaluation (4B model): P99 TTFT <= 20 s
TPOT_SLO_S = 0.100  # and P99 TPOT <= 100 ms
_READS = re.compile(r"embedding reads: cuda=(\d+) shm=(\d+) remote=(\d+)")


class Check:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t0 = time.monotonic()
        self.out = Path(args.out)
        self.data: dict[str, Any] = {"environment": environment(), "args": vars(args), "stages": {}}
        self.tables: list[str] = []
        self.failures: list[str] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def say(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {msg}", flush=True)

    def stage(self, name: str, fn, *a, **kw) -> Any:
        self.say(f"stage {name} ...")
        t = time.monotonic()
        rec: dict[str, Any] = {}
        self.data["stages"][name] = rec
        try:
            result = fn(*a, **kw)
            rec["status"] = "ok"
            return result
        except Exception as e:  # noqa: BLE001 - every stage reports, none hides the others
            rec["status"] = f"failed: {type(e).__name__}: {e}"[:2000]
            rec["traceback"] = traceback.format_exc()[-6000:]
            self.failures.append(f"{name}: {type(e).__name__}: {e}"[:500])
            self.say(f"stage {name} FAILED: {type(e).__name__}: {e}")
            traceback.print_exc()
            return None
        finally:
            rec["seconds"] = round(time.monotonic() - t, 2)
            self.say(f"stage {name}: {rec['status'][:80]} in {rec['seconds']} s")


def _torch_info(device: str) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                            "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}  # fmt: skip
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    gpu_uuid=str(getattr(props, "uuid", "")))  # fmt: skip
    return info


# ---------------------------------------------------------------- stages


def stage_handoff(chk: Check) -> dict[str, Any]:
    from epdq.benchmarks import handoff

    a = chk.args
    sizes = tuple(float(s) for s in a.handoff_sizes.split(","))
    data = handoff.run(
        sizes_mib=sizes, repeats=a.handoff_repeats, warmup=2, out_dir=chk.out, plot=False, progress=False,
        cuda=True if a.device.startswith("cuda") else None, device=a.device if a.device != "cpu" else "cuda:0",
        pool_mib=a.handoff_pool_mib, ring_mib=a.handoff_pool_mib,
    )  # fmt: skip
    chk.tables.append(handoff.render(data))
    chk.tables.append(handoff.render_cuda(data["cuda"], data["config"]))
    if a.device.startswith("cuda") and data["cuda"]["status"] != "ok":
        chk.failures.append(f"hand-off on the GPU: {data['cuda']['status'][:300]}")
    return {"cuda": {k: v for k, v in data["cuda"].items() if k != "results"},
            "cuda_results": [{k: v for k, v in r.items() if k != "samples_ms"} for r in data["cuda"].get("results", [])],
            "cpu_targets": data["targets"]}  # fmt: skip


def stage_ring_costs(chk: Check) -> dict[str, Any]:
    """The CUDA ring's write and read, and the calls they are made of, one at a time."""
    from epdq.benchmarks import ring_cuda_costs

    d = ring_cuda_costs.measure(chk.args.device, repeats=100 if chk.args.device.startswith("cuda") else 10)
    chk.tables.append(ring_cuda_costs.render(d))
    return d


def stage_checkpoint(chk: Check, path: Path):
    from epdq.models import real_shape as R

    a = chk.args
    over: dict[str, Any] = {}
    if a.layers:
        over["num_layers"] = a.layers
    if a.vision_depth:
        over["vision_depth"] = a.vision_depth
    if a.small_vocab:
        over.update(vocab_size=2304, special_base=2200)
    spec = R.preset(a.preset, **over)
    gen_device = a.device if a.device.startswith("cuda") else "cpu"
    R.write_checkpoint(path, spec, dtype=a.dtype, device=gen_device, overwrite=True, log=chk.say)
    n = R.parameter_count(spec)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    chk.data["checkpoint"] = {"preset": spec.name, "parameters": n, "bytes": size, "dtype": a.dtype,
                              "spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__}}  # fmt: skip
    chk.tables.append(table(["preset", "parameters", "GiB on disk", "layers", "hidden", "vision depth", "dtype"],
                            [(spec.name, f"{n / 1e9:.2f} B", size / 2**30, spec.num_layers, spec.hidden_size,
                              spec.vision_depth, a.dtype)], title="Random-weight checkpoint with real shapes"))  # fmt: skip
    return spec


def _images(seed: int, n: int, size: tuple[int, int]) -> list[bytes]:
    from epdq.demo import demo_image

    w, h = size
    shapes = [(w, h), (w * 3 // 4, h), (w, h * 2 // 3), (w // 2, h // 2)]
    return [demo_image(seed + i, shapes[i % len(shapes)]) for i in range(n)]


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where two outputs part, None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


async def _token_check(chk: Check, cluster, dtype: str, judged: bool) -> dict[str, Any]:
    a = chk.args
    size = (a.image_size, a.image_size)
    cases = [
        ("text only", []),
        ("one image", _images(100, 1, size)),
        ("two images", _images(200, 2, size)),
        ("four images", _images(300, 4, size)),
        ("same image twice", _images(400, 1, size) * 2),
    ]
    rows, recs = [], []
    async with cluster.client(timeout=600) as c:
        for name, imgs in cases:
            prompt = f"Describe the pictures ({name}) in detail."
            epd = await c.generate(prompt, images=imgs, max_tokens=a.max_tokens, route="epd")
            colo = await c.generate(prompt, images=imgs, max_tokens=a.max_tokens, route="colocated")
            same = epd.token_ids == colo.token_ids
            recs.append({"case": name, "images": len(imgs), "identical": same,
                         "first_difference": _first_difference(epd.token_ids, colo.token_ids), "epd": epd.token_ids,
                         "colocated": colo.token_ids, "epd_ttft_s": epd.timings.ttft_s,
                         "colocated_ttft_s": colo.timings.ttft_s, "encode_s": epd.timings.encode_s})  # fmt: skip
            rows.append((name, len(imgs), len(epd.token_ids),
                         "yes" if same else f"NO, from token {recs[-1]['first_difference']}",
                         " ".join(map(str, epd.token_ids[:8])), epd.timings.ttft_s * 1e3, colo.timings.ttft_s * 1e3,
                         epd.timings.encode_s * 1e3))  # fmt: skip
            chk.say(f"token check {name}: {'identical' if same else 'DIFFERENT'}")
        stats = await c.stats()
    ok = all(r["identical"] for r in recs)
    varied = len({tuple(r["epd"]) for r in recs}) > 1
    chk.tables.append(table(["case", "images", "tokens", "identical", "first EPD tokens", "EPD TTFT ms",
                             "colocated TTFT ms", "encode ms"], rows,
                            title=f"Token check, {dtype}: encoder -> ring -> PD vs the same model fed pixels (greedy"
                                  + ("" if judged else "; reported, judged in float32") + ")"))  # fmt: skip
    if judged and not ok:
        chk.failures.append(f"token check ({dtype}): EPD output differs from the colocated worker's")
    return {"dtype": dtype, "judged": judged, "identical": ok, "outputs_vary": varied, "cases": recs, "counters": stats["counters"]}


async def _goodput(chk: Check, cluster) -> dict[str, Any]:
    a = chk.args
    until = a.budget_s - a.reserve_s  # the rest of the budget is for the float32 check and the diagnostics
    qps_list = [float(q) for q in a.goodput_qps.split(",")]
    size = (a.image_size, a.image_size)
    points, seed = [], 10_000
    async with cluster.client(timeout=600) as c:
        for route in ("epd", "colocated"):  # warm-up of each route's engines at this image size
            await c.generate("warm up", images=_images(seed, 2, size), max_tokens=2, route=route)
            seed += 2
        for qps in qps_list:
            for route in ("epd", "colocated"):
                if chk.elapsed() > until:
                    chk.say(f"goodput: its {until:.0f} s are spent; skipping {route} at {qps} QPS")
                    continue
                reqs = []
                for _ in range(a.requests):
                    reqs.append(_images(seed, a.goodput_images, size))
                    seed += a.goodput_images
                p, results = await measure_point(
                    c, route, qps, reqs, random.Random(int(qps * 1000)), max_tokens=a.goodput_tokens,
                    ttft_slo_s=TTFT_SLO_S, tpot_slo_s=TPOT_SLO_S,
                )  # fmt: skip
                elapsed = p["elapsed_s"]
                p["errors"] = [str(r)[:200] for r in results if isinstance(r, Exception)]
                p["throughput_rps"] = p["completed"] / elapsed if elapsed > 0 else 0.0
                p["goodput_rps"] = goodput_rps(p)
                points.append(p)
                chk.say(f"goodput {route} at {qps} QPS: {p['completed']}/{len(reqs)} done, TTFT p50 {p['ttft_p50']:.3f} s")
    rows = [(p["route"], p["offered_qps"], f"{p['completed']}/{p['requests']}", p["ttft_p50"], p["ttft_p99"],
             p["tpot_p50"] * 1e3, p["tpot_p99"] * 1e3, p["encode_p50"] * 1e3, p["throughput_rps"], p["goodput_rps"],
             "yes" if p["meets_slo"] else "no") for p in points]  # fmt: skip
    chk.tables.append(table(
        ["route", "offered QPS", "done", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms", "TPOT p99 ms", "encode p50 ms",
         "req/s", "goodput req/s", "SLO"], rows,
        title=f"Short goodput run ({a.requests} requests per point, {a.goodput_images} images of {a.image_size}² px, "
              f"{a.goodput_tokens} output tokens; SLO P99 TTFT <= {TTFT_SLO_S:g} s, TPOT <= {TPOT_SLO_S * 1e3:.0f} ms; "
              "EPD = 1 encoder + 1 PD, colocated = 1 worker, all on the same GPU, routes measured one after the other)",
    ))  # fmt: skip
    if any(p["errors"] for p in points):
        chk.failures.append("goodput: some requests failed")
    return {"slo": {"ttft_p99_s": TTFT_SLO_S, "tpot_p99_s": TPOT_SLO_S}, "points": points}


def stage_cluster(chk: Check, model: Path, work: Path, dtype: str = "", tokens_only: bool = False) -> None:
    """Start the cluster, check tokens, then (unless `tokens_only`) run the short goodput run.

    `tokens_only`: the float32 token check (stage 7): only the token check, in `dtype`, on a fresh
    cluster from the same checkpoint; judged, where the check in bf16/fp16 is only reported."""
    from epdq.cluster import Cluster, ClusterSpec

    a = chk.args
    dtype = dtype or a.dtype
    logs = work / ("logs-" + dtype if tokens_only else "logs")
    defaults = {"engine": "hf", "device": a.device, "dtype": dtype, "ring": a.ring, "max_model_len": 8192,
                "ring_bytes": a.ring_mib << 20, "max_images_per_prompt": 8}  # fmt: skip
    spec = ClusterSpec(address=f"ipc://{work}/broker{'-' + dtype if tokens_only else ''}.sock", encoders=1, pds=1, both=1,
                       model=str(model), worker_defaults=defaults, log_dir=str(logs),
                       start_timeout_s=a.start_timeout_s)  # fmt: skip
    cluster = Cluster(spec)

    async def main() -> None:
        t = time.monotonic()
        try:
            await cluster.start(progress=chk.say)
            if tokens_only:
                chk.data["token_check_" + dtype] = await _token_check(chk, cluster, dtype, judged=True)
                return
            chk.data["cluster_start_s"] = round(time.monotonic() - t, 1)
            chk.data["token_check"] = await _token_check(chk, cluster, dtype, judged=dtype == "float32")
            if chk.elapsed() < a.budget_s - a.reserve_s - 30:
                res = await _goodput(chk, cluster)
                chk.data["goodput"] = res
            else:
                chk.say("goodput skipped: time budget spent")
                chk.data["goodput"] = {"skipped": "time budget spent"}
        finally:
            await asyncio.to_thread(cluster.stop)

    try:
        asyncio.run(main())
    finally:
        if tokens_only:
            chk.data.setdefault("logs", {}).update({f"{dtype}/{k}": v for k, v in _logs(logs).items()})
        else:
            chk.data["logs"] = _logs(logs)
            _check_ring_path(chk, logs)


def stage_diagnostics(chk: Check, model: Path) -> None:
    """In this process, the cluster stopped: the vision rows three ways per dtype, one decode step."""
    from epdq.benchmarks import gpu_diag

    a = chk.args
    dtypes = [a.dtype] + (["float32"] if a.dtype != "float32" else [])
    size = (a.image_size, a.image_size)
    rounding = gpu_diag.vision_rounding(model, a.device, dtypes, _images(200, 2, size))  # the "two images" case
    chk.data["vision_rounding"] = rounding
    for r in rounding:
        if not r["encoder_vs_full_model"]["identical"]:
            chk.failures.append(f"diagnostics ({r['dtype']}): the encoder's vision tower differs from the full model's "
                                f"at equal grouping (max |diff| {r['encoder_vs_full_model']['max_abs']})")
    steps = gpu_diag.decode_steps(model, a.device, a.dtype)
    chk.data["decode_steps"] = steps
    for title, headers, rows in gpu_diag.render(rounding, steps):
        chk.tables.append(table(headers, rows, title=title))


def _logs(d: Path) -> dict[str, str]:
    out = {}
    for f in sorted(d.glob("*.log")) if d.is_dir() else []:
        lines = f.read_text(errors="replace").splitlines()
        out[f.name] = "\n".join(lines[-120:])
    return out


def _check_ring_path(chk: Check, logs: Path) -> None:
    want = chk.args.ring if chk.args.ring != "auto" else ("cuda" if chk.args.device.startswith("cuda") else "shm")
    pd = (logs / "pd-0.log").read_text(errors="replace") if (logs / "pd-0.log").is_file() else ""
    enc = (logs / "encoder-0.log").read_text(errors="replace") if (logs / "encoder-0.log").is_file() else ""
    m = _READS.findall(pd)
    rec: dict[str, Any] = {"expected": want, "encoder_ring": "cuda" if "ring cuda-" in enc else "shm" if "ring epdq-" in enc else "?",
                           "mapped": "mapped CUDA ring" in pd, "fallback_warnings": pd.count("through the encoder's fetch socket")}  # fmt: skip
    if m:
        cuda, shm, remote = map(int, m[-1])
        rec.update(cuda_reads=cuda, shm_reads=shm, remote_reads=remote)
    if want == "cuda":
        ok = rec["encoder_ring"] == "cuda" and rec.get("cuda_reads", 0) > 0 and rec.get("remote_reads", 1) == 0
    else:
        ok = rec["encoder_ring"] == "shm" and rec["fallback_warnings"] == 0
    rec["ok"] = ok
    chk.data["ring_path"] = rec
    chk.tables.append(table(["expected ring", "encoder's ring", "PD mapped it", "D2D reads", "shm reads", "fetched",
                             "fallback warnings", "ok"],
                            [(want, rec["encoder_ring"], rec["mapped"], rec.get("cuda_reads", "n/a"),
                              rec.get("shm_reads", "n/a"), rec.get("remote_reads", "n/a"), rec["fallback_warnings"],
                              "yes" if ok else "NO")], title="How the PD worker read the embeddings (from its log)"))  # fmt: skip
    if not ok:
        chk.failures.append(f"ring path: expected {want} reads, got {rec}")


# ---------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m epdq.benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-check-results")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--preset", default="qwen2.5-vl-3b")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--ring", default="auto", choices=("auto", "shm", "cuda"))
    ap.add_argument("--layers", type=int, default=0, help="fewer decoder layers (0: the preset's)")
    ap.add_argument("--vision-depth", type=int, default=0, help="fewer vision blocks (0: the preset's)")
    ap.add_argument("--small-vocab", action="store_true", help="a 2304-token vocabulary (CPU dry runs)")
    ap.add_argument("--work", default="", help="checkpoint and logs (default: a fresh temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--budget-s", type=float, default=330.0, help="no goodput point starts after this")
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--ring-mib", type=int, default=512)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--goodput-qps", default="1,2,4")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--goodput-images", type=int, default=2)
    ap.add_argument("--goodput-tokens", type=int, default=32)
    ap.add_argument("--handoff-sizes", default="1,8,32")
    ap.add_argument("--handoff-repeats", type=int, default=10)
    ap.add_argument("--handoff-pool-mib", type=int, default=256)
    ap.add_argument("--skip", default="", help="comma-separated stages to skip: handoff, ring-costs, cluster")
    ap.add_argument("--no-diagnostics", action="store_true",
                    help="skip the in-process diagnostics (vision rows three ways, one decode step)")
    ap.add_argument("--reserve-s", type=float, default=-1.0,
                    help="seconds kept after the goodput run for the float32 token check and the diagnostics "
                         "(default: 100 when the dtype is not float32, else 30)")
    args = ap.parse_args(argv)
    from epdq.worker.devices import check_device, resolve_dtype

    args.device = check_device(args.device)
    args.dtype = resolve_dtype(args.dtype, args.device)
    if args.reserve_s < 0:
        args.reserve_s = 100.0 if args.dtype != "float32" else 30.0
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    chk = Check(args)
    chk.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _killed)  # `timeout` in the shell script: still write what we have
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="epdq-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("EPDQ_HOME", str(work / "home"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        chk.data["torch"] = chk.stage("environment", _torch_info, args.device)
        chk.say(f"environment: {chk.data['torch']}")
        if "handoff" not in skip:
            chk.data["handoff"] = chk.stage("handoff", stage_handoff, chk)
        if "ring-costs" not in skip:
            chk.data["ring_cuda_costs"] = chk.stage("ring-costs", stage_ring_costs, chk)
        if "cluster" not in skip:
            model = work / "model"
            if chk.stage("checkpoint", stage_checkpoint, chk, model) is not None:
                chk.stage("cluster", stage_cluster, chk, model, work)
                if args.dtype != "float32":
                    if chk.elapsed() < args.budget_s:
                        chk.stage("token-check-float32", stage_cluster, chk, model, work, "float32", True)
                    else:
                        chk.say("float32 token check skipped: time budget spent")
                    if "token_check_float32" not in chk.data:
                        chk.failures.append("token check: the float32 run, which judges it, did not finish")
                if chk.elapsed() < args.budget_s and not args.no_diagnostics:
                    chk.stage("diagnostics", stage_diagnostics, chk, model)
            else:
                chk.failures.append("cluster: not started (no checkpoint)")
    except Killed as e:
        chk.failures.append(str(e))
    finally:
        chk.data["total_s"] = round(chk.elapsed(), 1)
        chk.data["failures"] = chk.failures
        chk.data["passed"] = not chk.failures
        _write(chk)
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print("\n".join(chk.tables))
    print(f"\nGPU check {'PASSED' if not chk.failures else 'FAILED'} in {chk.elapsed():.0f} s; files in {chk.out}")
    for f in chk.failures:
        print(f"  - {f}")
    return 0 if not chk.failures else 1


class Killed(BaseException):
    """SIGTERM: unwinds past the stages (which catch Exception) to the summary."""


def _killed(*_a: Any) -> None:
    raise Killed("terminated (time limit)")


def _write(chk: Check) -> None:
    stages = [(k, v.get("status", "")[:90], v.get("seconds", "")) for k, v in chk.data["stages"].items()]
    head = table(["stage", "status", "seconds"], stages, title="Stages")
    verdict = "PASSED" if not chk.failures else "FAILED: " + "; ".join(chk.failures)
    env = chk.data.get("torch") or {}
    lines = [f"# epdq GPU check: {verdict}", "", f"device {chk.args.device}, {env}", f"total {chk.elapsed():.0f} s",
             head, *chk.tables]  # fmt: skip
    (chk.out / "summary.md").write_text("\n".join(lines) + "\n")
    logs = chk.data.pop("logs", {})
    (chk.out / "logs.txt").write_text("".join(f"\n===== {k} (last lines)\n{v}\n" for k, v in logs.items()))
    (chk.out / "gpu_check.json").write_text(json.dumps(chk.data, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
