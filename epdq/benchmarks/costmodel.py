"""A cost model of encoder, prefill and decode time, and a discrete-event simulation of EPD and
colocated serving driven by the REAL scheduler (`epdq.scheduler.Scheduler`, injected clock).

No model runs and nothing sleeps: workers are simulated servers whose service times come from the
formulas below; every dispatch decision (encode jobs to encoders, ready requests to PD or colocated
workers, credits, cache hits, dedup joins) is taken by the production scheduling code. This is how
the goodput benchmark studies scheduling at scale (`epdq.benchmarks.goodput`, kind "cost").

Cost formulas (constants in `CostModel`; defaults describe a ~2B Qwen2-VL-class model, a 675M-param
vision tower and a ~1.5B LLM, on one A100-class accelerator per worker):

    image tokens        = ceil(w/28) * ceil(h/28)        (14-px patches merged 2x2, as Qwen2-VL)
    encode(images)      = enc_call_s + sum(enc_image_s + enc_s_per_mpx * megapixels(image))
                          one vision-tower forward over a batch of images
    engine step         = step_s + decode_s_per_seq * decoding_sequences
                               + prefill_s_per_token * prefill_tokens_in_this_step
                               [+ encode(images whose placeholders this step's chunk reaches)]
                                                           <- colocated engine only
    hand-off (EPD)      = embedding_bytes / handoff_bytes_per_s before the PD worker admits it

LLM engines (PD and colocated workers) do iteration-level continuous batching with chunked
prefill, as vLLM V1 does: each step first gives every decoding sequence one token, then fills the
remaining `max_batched_tokens` budget with prompt chunks of the admitted sequences in FIFO order.
A sequence's first token comes out of the step that finishes its prompt; each later step emits one
token; it ends after exactly `max_tokens` tokens (as the noop PD engine does).

The difference between the two systems is where the vision tower runs:

* EPD (1 encoder + N PD): the encoder worker is a separate accelerator. When it becomes free
  it runs one forward over the oldest jobs it holds, at most 8 (its credit is 16: the next batch
  waits there), then reports each embedding to the scheduler (`on_encoded`). PD engines never
  run the vision tower.
* Colocated (N+1 `both` workers): the vision tower runs INSIDE the engine step, serialised with
  the prefills and decodes of every sequence on that engine (vLLM's model runner executes the
  encoder for the multimodal inputs a step schedules before the LLM forward). A step whose prompt
  chunk reaches a request's image placeholders pays that image's encode, and every sequence
  decoding on that engine waits for it. There is no cross-request embedding cache.

What the model leaves out: CPU pre-processing, network, the broker's own latency (measured
separately in the pipeline benchmarks), KV-cache capacity beyond the worker's sequence credit,
and ring eviction (the simulated embedding index keeps every entry).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from epdq.jobs import Fail, Role, SendEncode, SendPrefill
from epdq.protocol import EmbedRef
from epdq.scheduler import Scheduler, SchedulerConfig


@dataclass(frozen=True, slots=True)
class CostModel:
    # vision tower (one forward over a batch of images)
    enc_call_s: float = 0.004  # fixed per forward (launches, synchronisation)
    enc_image_s: float = 0.002  # fixed per image
    enc_s_per_mpx: float = 0.110  # per megapixel (patch embedding, 32 full-attention layers)
    # LLM engine step
    step_s: float = 0.008  # per step: weight reads, sampling, scheduling
    decode_s_per_seq: float = 0.0002  # per decoding sequence in the step (KV reads)
    prefill_s_per_token: float = 0.00002  # per prompt token computed in the step
    max_batched_tokens: int = 2048  # chunked-prefill token budget per step
    # EPD hand-off of embeddings (ring copy or fetch)
    hidden_size: int = 1536
    embed_bytes_per_value: int = 2
    handoff_bytes_per_s: float = 10e9

    def __post_init__(self) -> None:
        for name in ("enc_call_s", "enc_image_s", "enc_s_per_mpx", "step_s", "decode_s_per_seq", "prefill_s_per_token"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, not {v!r}")
        for name in ("max_batched_tokens", "hidden_size", "embed_bytes_per_value"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name} must be an integer >= 1, not {v!r}")
        if not (math.isfinite(self.handoff_bytes_per_s) and self.handoff_bytes_per_s > 0):
            raise ValueError(f"handoff_bytes_per_s must be > 0, not {self.handoff_bytes_per_s!r}")

    def image_tokens(self, w: int, h: int) -> int:
        return math.ceil(w / 28) * math.ceil(h / 28)

    def encode_s(self, sizes: list[tuple[int, int]]) -> float:
        if not sizes:
            return 0.0
        return self.enc_call_s + sum(self.enc_image_s + self.enc_s_per_mpx * w * h / 1e6 for w, h in sizes)

    def handoff_s(self, sizes: list[tuple[int, int]]) -> float:
        tokens = sum(self.image_tokens(w, h) for w, h in sizes)
        return tokens * self.hidden_size * self.embed_bytes_per_value / self.handoff_bytes_per_s

    def describe(self) -> dict[str, Any]:
        return {
            "formula": {
                "image_tokens": "ceil(w/28) * ceil(h/28)",
                "encode_batch_s": "enc_call_s + sum(enc_image_s + enc_s_per_mpx * megapixels)",
                "engine_step_s": "step_s + decode_s_per_seq * decoding + prefill_s_per_token * prefill_tokens"
                " [+ encode of images reached by this step's chunk, colocated only]",
                "handoff_s": "image_tokens * hidden_size * embed_bytes_per_value / handoff_bytes_per_s",
            },
            "constants": asdict(self),
        }


MAX_IMAGES = 64  # images per request
MAX_TOKENS = 1 << 20  # prompt text or output tokens per request
MAX_SIDE = 16384  # image width or height, px


@dataclass(frozen=True, slots=True)
class Workload:
    images_per_request: int = 4
    image_size: tuple[int, int] = (512, 512)
    text_tokens: int = 128
    output_tokens: int = 128
    repeat_fraction: float = 0.0  # probability that an image is drawn from the hot set
    hot_set: int = 32  # distinct images in the hot set
    seed: int = 0

    def __post_init__(self) -> None:
        def check_int(name: str, lo: int, hi: int) -> None:
            v = getattr(self, name)
            if not (isinstance(v, int) and lo <= v <= hi):
                raise ValueError(f"{name} must be an integer in {lo}..{hi}, not {v!r}")

        check_int("images_per_request", 1, MAX_IMAGES)
        check_int("text_tokens", 0, MAX_TOKENS)
        check_int("output_tokens", 1, MAX_TOKENS)
        check_int("hot_set", 1, 10**6)
        if len(self.image_size) != 2 or not all(isinstance(v, int) and 1 <= v <= MAX_SIDE for v in self.image_size):
            raise ValueError(f"image_size must be (width, height) in 1..{MAX_SIDE} px, not {self.image_size!r}")
        if not (isinstance(self.repeat_fraction, (int, float)) and 0 <= self.repeat_fraction <= 1):
            raise ValueError(f"repeat_fraction must be in [0, 1], not {self.repeat_fraction!r}")

    def describe(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Spec:
    """One simulated request (the scheduler's `payload`)."""

    index: int
    arrival: float
    images: list[tuple[int, int]]
    keys: list[bytes]
    prompt_tokens: int
    image_starts: list[int]  # first placeholder position of each image in the prompt
    max_tokens: int
    first: float = math.nan
    done: float = math.nan


def make_requests(
    wl: Workload, cm: CostModel, qps: float, n: int, *, unique_keys: bool = False
) -> list[Spec]:
    """Poisson arrivals at `qps`; images drawn from a hot set with probability repeat_fraction.

    `unique_keys` gives every image its own content hash (the cache disabled)."""
    rng = random.Random(wl.seed * 1_000_003 + round(qps * 1000))
    t = 0.0
    out = []
    fresh = 0
    for i in range(n):
        t += rng.expovariate(qps)
        keys = []
        for _ in range(wl.images_per_request):
            if rng.random() < wl.repeat_fraction:
                keys.append(b"hot-%d" % rng.randrange(wl.hot_set))
            else:
                keys.append(b"new-%d" % fresh)
                fresh += 1
        if unique_keys:
            keys = [b"u-%d-%d" % (i, j) for j in range(len(keys))]
        sizes = [wl.image_size] * wl.images_per_request
        starts, pos = [], 0
        for w, h in sizes:  # images first, then the text (as a chat turn with images up front)
            starts.append(pos)
            pos += cm.image_tokens(w, h)
        out.append(Spec(i, t, sizes, keys, pos + wl.text_tokens, starts, wl.output_tokens))
    return out


# ---------------------------------------------------------------- the simulation


class _Events:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn))

    def run(self) -> None:
        while self._heap:
            t, _, fn = heapq.heappop(self._heap)
            self.now = t
            fn()


@dataclass(slots=True)
class _Seq:
    spec: Spec
    rid: str
    done_tokens: int = 0  # prompt tokens computed
    next_image: int = 0  # images encoded so far (colocated)
    out: int = 0  # tokens emitted


class _Engine:
    """An LLM engine (PD or colocated) doing continuous batching with chunked prefill."""

    def __init__(self, sim: Simulation, wid: str, colocated: bool):
        self.sim, self.wid, self.colocated = sim, wid, colocated
        self.seqs: list[_Seq] = []
        self.busy = False
        self.busy_s = 0.0
        self.encode_s = 0.0

    def admit(self, seq: _Seq) -> None:
        self.seqs.append(seq)
        if not self.busy:
            self._step()

    def _step(self) -> None:
        cm = self.sim.cm
        decoding = [s for s in self.seqs if s.done_tokens >= s.spec.prompt_tokens]
        budget = cm.max_batched_tokens - len(decoding)
        dur = cm.step_s + cm.decode_s_per_seq * len(decoding)
        chunks: list[tuple[_Seq, int]] = []
        enc: list[tuple[int, int]] = []
        for s in self.seqs:
            if budget <= 0:
                break
            left = s.spec.prompt_tokens - s.done_tokens
            if left <= 0:
                continue
            n = min(budget, left)
            if self.colocated:
                sp = s.spec
                while s.next_image < len(sp.images) and sp.image_starts[s.next_image] < s.done_tokens + n:
                    enc.append(sp.images[s.next_image])
                    s.next_image += 1
            chunks.append((s, n))
            budget -= n
            dur += cm.prefill_s_per_token * n
        if not decoding and not chunks:
            self.busy = False
            return
        if enc:
            e = cm.encode_s(enc)
            dur += e
            self.encode_s += e
        self.busy = True
        self.busy_s += dur
        self.sim.ev.at(self.sim.ev.now + dur, lambda: self._end_step(decoding, chunks))

    def _end_step(self, decoding: list[_Seq], chunks: list[tuple[_Seq, int]]) -> None:
        now = self.sim.ev.now
        finished = []
        for s in decoding:
            s.out += 1
            if s.out >= s.spec.max_tokens:
                finished.append(s)
        for s, n in chunks:
            s.done_tokens += n
            if s.done_tokens >= s.spec.prompt_tokens:  # the prompt's last chunk yields token 1
                s.out = 1
                s.spec.first = now
                if s.spec.max_tokens <= 1:
                    finished.append(s)
                else:
                    self.sim.scheduler.on_tokens(self.wid, s.rid, False)
        for s in finished:
            s.spec.done = now
            self.seqs.remove(s)
            self.sim.scheduler.on_tokens(self.wid, s.rid, True)
        self.sim.pump()
        self._step()


# as WorkerConfig's defaults: a forward takes at most ENCODER_MAX_BATCH of the jobs an encoder
# holds, and it holds two batches (the next one waits there while a forward runs)
ENCODER_MAX_BATCH = 8
ENCODER_CREDIT = 2 * ENCODER_MAX_BATCH
PD_CREDIT = 16  # sequences a PD or colocated engine holds, so the most one step decodes


class _Encoder:
    """A dedicated encoder: whenever it becomes free, one forward over the oldest jobs it holds, at
    most `max_batch` of them (EncoderWorker.run)."""

    def __init__(self, sim: Simulation, wid: str, max_batch: int = ENCODER_MAX_BATCH):
        self.sim, self.wid, self.max_batch = sim, wid, max_batch
        self.jobs: deque = deque()
        self.busy = False
        self.busy_s = 0.0
        self.images = 0
        self.batches = 0

    def give(self, job: Any) -> None:
        self.jobs.append(job)
        if not self.busy:
            self._start()

    def _start(self) -> None:
        if not self.jobs:
            self.busy = False
            return
        jobs = self.jobs
        batch = [jobs.popleft() for _ in range(min(len(jobs), self.max_batch))]
        sizes = [self.sim.key_size[j.key] for j in batch]
        dur = self.sim.cm.encode_s(sizes)
        self.busy = True
        self.busy_s += dur
        self.images += len(batch)
        self.batches += 1
        self.sim.ev.at(self.sim.ev.now + dur, lambda: self._end(batch))

    def _end(self, batch: list) -> None:
        cm = self.sim.cm
        for job in batch:
            w, h = self.sim.key_size[job.key]
            tokens = cm.image_tokens(w, h)
            ref = EmbedRef(job.key, self.wid, "node-0", "sim", 0, tokens * cm.hidden_size * cm.embed_bytes_per_value,
                           1, "bfloat16", [tokens, cm.hidden_size], [1, 2 * math.ceil(h / 28), 2 * math.ceil(w / 28)],
                           "")  # fmt: skip
            self.sim.scheduler.on_encoded(self.wid, job.job_id, ref)
        self.sim.pump()
        self._start()


def capacity_rps(
    system: str, cm: CostModel, wl: Workload, *, unique_keys: bool = False, encoders: int = 1, pds: int = 3,
    both: int = 4, encoder_max_batch: int = ENCODER_MAX_BATCH, pd_credit: int = PD_CREDIT,
) -> float:  # fmt: skip
    """An upper bound on the requests/s the system can sustain: each stage's work per request
    taken at its least (the encoder's fixed cost shared by a full batch, an engine's step cost by a
    full set of decoding sequences, no fixed encode cost in a colocated step, only the images not
    drawn from the hot set encoded), the stages' capacities, and the smallest of them. Above it the
    queue grows without end, however a finite window's percentiles look: at 8.0 req/s against
    7.978 for 1 encoder with 4 images of 512x512 per request, a 120 s window met the SLOs for one
    arrival seed (its queue grows ~0.02 requests/s, less than the window's noise)."""
    per_image = cm.enc_image_s + cm.enc_s_per_mpx * wl.image_size[0] * wl.image_size[1] / 1e6
    images = wl.images_per_request
    tokens = images * cm.image_tokens(*wl.image_size) + wl.text_tokens
    engine = (tokens * cm.prefill_s_per_token
              + (wl.output_tokens - 1) * (cm.decode_s_per_seq + cm.step_s / pd_credit))  # fmt: skip
    encoded = images if unique_keys else images * (1.0 - wl.repeat_fraction)
    if system == "colocated":
        return _per_second(both, engine + encoded * per_image)
    encoder = encoded * (cm.enc_call_s / encoder_max_batch + per_image)
    return min(_per_second(encoders, encoder), _per_second(pds, engine))


def _per_second(servers: int, seconds_per_request: float) -> float:
    return servers / seconds_per_request if seconds_per_request > 0 else math.inf


class Simulation:
    """One system (EPD or colocated) under one arrival sequence; `run()` returns per-request specs.

    system "epd": `encoders` encoder workers + `pds` PD workers, requests on route "epd";
    system "colocated": `both` colocated workers, route "colocated"."""

    def __init__(
        self, system: str, cm: CostModel, *, encoders: int = 1, pds: int = 3, both: int = 4,
        encoder_credit: int = ENCODER_CREDIT, encoder_max_batch: int = ENCODER_MAX_BATCH, pd_credit: int = PD_CREDIT,
    ) -> None:  # fmt: skip
        if system not in ("epd", "colocated"):
            raise ValueError("system must be epd or colocated")
        if not 1 <= encoder_max_batch <= encoder_credit:
            raise ValueError("encoder_max_batch must be in [1, encoder_credit]")
        self.system, self.cm = system, cm
        self.ev = _Events()
        self.scheduler = Scheduler(SchedulerConfig(max_queued_requests=10**9, max_held_image_bytes=2**62),
                                   clock=lambda: self.ev.now)  # fmt: skip
        self.encoders: dict[str, _Encoder] = {}
        self.engines: dict[str, _Engine] = {}
        self.key_size: dict[bytes, tuple[int, int]] = {}
        self.failed: list[Fail] = []
        if system == "epd":
            for i in range(encoders):
                self.encoders[f"enc-{i}"] = _Encoder(self, f"enc-{i}", encoder_max_batch)
                self.scheduler.add_worker(f"enc-{i}", Role.ENCODER, "node-0", encoder_credit)
            for i in range(pds):
                self.engines[f"pd-{i}"] = _Engine(self, f"pd-{i}", colocated=False)
                self.scheduler.add_worker(f"pd-{i}", Role.PD, "node-0", pd_credit)
        else:
            for i in range(both):
                self.engines[f"both-{i}"] = _Engine(self, f"both-{i}", colocated=True)
                self.scheduler.add_worker(f"both-{i}", Role.BOTH, "node-0", pd_credit)
        self.pump()

    def pump(self) -> None:
        for a in self.scheduler.take_actions():
            if isinstance(a, SendEncode):
                self.encoders[a.worker_id].give(a.job)
            elif isinstance(a, SendPrefill):
                spec: Spec = a.request.payload
                seq = _Seq(spec, a.request.rid)
                eng = self.engines[a.worker_id]
                if a.refs:  # the PD worker copies the embeddings before admitting the sequence
                    delay = self.cm.handoff_s(spec.images)
                    self.ev.at(self.ev.now + delay, lambda e=eng, s=seq: e.admit(s))
                else:
                    eng.admit(seq)
            elif isinstance(a, Fail):
                self.failed.append(a)
            # SendPin / SendUnpin / SendAbort: nothing to simulate (no eviction in the model)

    def _arrive(self, spec: Spec) -> None:
        route = self.system
        if route == "epd":
            for k, sz in zip(spec.keys, spec.images, strict=True):
                self.key_size[k] = sz
            self.scheduler.submit(
                f"r{spec.index}", b"c", spec.keys, [b""] * len(spec.keys), 3600.0, spec, route
            )
        else:
            self.scheduler.submit(f"r{spec.index}", b"c", [], [], 3600.0, spec, route)
        self.pump()

    def run(self, specs: list[Spec]) -> dict[str, Any]:
        for s in specs:
            self.ev.at(s.arrival, lambda s=s: self._arrive(s))
        self.ev.run()
        end = self.ev.now or 1.0
        return {
            "counters": dict(self.scheduler.counters),
            "failed": len(self.failed),
            "sim_end_s": end,
            "engine_util": {w: e.busy_s / end for w, e in self.engines.items()},
            "engine_encode_share": {
                w: (e.encode_s / e.busy_s if e.busy_s else 0.0) for w, e in self.engines.items()
            },
            "encoder_util": {w: e.busy_s / end for w, e in self.encoders.items()},
            "encoder_mean_batch": {
                w: (e.images / e.batches if e.batches else 0.0) for w, e in self.encoders.items()
            },
        }


@dataclass(slots=True)
class PointResult:
    system: str
    offered_qps: float
    requests: int
    completed: int
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    within_slo: int
    goodput_rps: float  # offered QPS x the fraction of requests finished within both SLOs
    meets_slo: bool  # every request done, both P99s within the SLOs, and offered_qps <= capacity_rps
    extra: dict = field(default_factory=dict)
    capacity_rps: float = math.inf  # `capacity_rps()`: the most the system can sustain, at best


def simulate_point(
    system: str, cm: CostModel, wl: Workload, qps: float, n_requests: int, *, ttft_slo: float, tpot_slo: float,
    unique_keys: bool = False, encoders: int = 1, pds: int = 3, both: int = 4,
) -> PointResult:  # fmt: skip
    from epdq.benchmarks.report import percentile

    specs = make_requests(wl, cm, qps, n_requests, unique_keys=unique_keys)
    sim = Simulation(system, cm, encoders=encoders, pds=pds, both=both)
    info = sim.run(specs)
    done = [s for s in specs if not math.isnan(s.done)]
    ttft = [s.first - s.arrival for s in done]
    tpot = [(s.done - s.first) / (s.max_tokens - 1) for s in done if s.max_tokens > 1]
    tpot_all = [(s.done - s.first) / (s.max_tokens - 1) if s.max_tokens > 1 else 0.0 for s in done]
    ok = sum(1 for a, b in zip(ttft, tpot_all, strict=True) if a <= ttft_slo and b <= tpot_slo)
    p99t, p99p = percentile(ttft, 99), percentile(tpot, 99) if tpot else 0.0
    cap = capacity_rps(system, cm, wl, unique_keys=unique_keys, encoders=encoders, pds=pds, both=both)
    # an overloaded point is not met even when its finite window's P99s are within the SLOs
    meets = len(done) == len(specs) and p99t <= ttft_slo and p99p <= tpot_slo and qps <= cap
    return PointResult(
        system, qps, len(specs), len(done), percentile(ttft, 50), p99t,
        percentile(tpot, 50) if tpot else 0.0, p99p, ok, qps * ok / max(1, len(specs)), meets, info, cap,
    )  # fmt: skip
