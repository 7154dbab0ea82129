"""The `epdq` command: parses arguments and calls the library, nothing more."""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import sys
from pathlib import Path

import typer

from epdq.errors import ConfigError, EngineError, EpdqError, InvalidInputError

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Encoder-disaggregated VLM serving over ZeroMQ."
)



def _print_version(value: bool) -> None:
    if value:
        from epdq import __version__
        from epdq.protocol import PROTOCOL_VERSION

        # a cluster runs one release: the protocol number is what brokers and workers compare
        typer.echo(f"epdq {__version__} (wire protocol {PROTOCOL_VERSION})")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print epdq's version and wire protocol, then exit."),
) -> None:  # fmt: skip
    pass


DEFAULT_ADDRESS = "tcp://127.0.0.1:7700"
KEYS_HELP = "CURVE keys directory (default: $EPDQ_HOME/keys, made by `epdq up` / `epdq keygen`)."
INSECURE_HELP = "Plaintext tcp instead of CURVE (loopback addresses only)."
CPUS_HELP = (
    "CPUs this process runs on, its ZeroMQ I/O thread included (taskset -c syntax: 0, 0-3, 0,2,4-7); "
    "default: wherever the kernel puts it (README: CPU placement)."
)


def _one_address(positional: str, option: str | None) -> str:
    # clients name the broker positionally or as --broker, like `epdq worker --broker`
    if option is None:
        return positional
    if positional != DEFAULT_ADDRESS and positional != option:
        raise typer.BadParameter(f"two broker addresses given: {positional!r} and {option!r}")
    return option


def _setup_logging(level: str, fmt: str, *, vllm: bool = False) -> None:
    from epdq.logs import setup_logging

    try:
        setup_logging(level, fmt, vllm=vllm)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--log-format") from None


MAX_MIB = 2**20  # 1 TiB: more than any of these limits can sensibly be


def _mib(value: float, flag: str) -> int:
    """A size option given in MiB, as bytes. int(inf * 2**20) raised OverflowError (a traceback),
    and NaN reached the config's check, whose message named the config field, not the flag; the
    config still checks the range each setting allows (and names the flag)."""
    if not (math.isfinite(value) and value <= MAX_MIB):
        raise typer.BadParameter(f"{flag} must be a number of MiB up to {MAX_MIB}, got {value}")
    return int(value * 2**20)


def _run(coro):
    from epdq.launch import run

    return run(coro)


@app.command()
def broker(
    address: str = typer.Option(DEFAULT_ADDRESS, help="Where clients and workers connect."),
    max_queued: int = typer.Option(1024, help="Requests waiting or ready before new ones get 'busy'."),
    max_images: int = typer.Option(8, help="Images allowed per request."),
    max_image_mb: float = typer.Option(20.0, help="Largest image file accepted, MiB."),
    max_held_image_mb: float = typer.Option(
        1024.0, help="Image bytes the broker holds for live requests, MiB; beyond it new requests get 'busy'."
    ),
    timeout: float = typer.Option(120.0, help="Default request deadline, seconds."),
    heartbeat: float = typer.Option(1.0, help="Heartbeat interval to workers, seconds."),
    liveness: int = typer.Option(5, help="Missed heartbeats before a worker is declared dead."),
    client_liveness: float = typer.Option(10.0, help="Seconds a client with live requests may stay silent."),
    encode_lease: float = typer.Option(60.0, help="Seconds an encoder may hold a job before it is re-queued."),
    unpin_delay: float = typer.Option(
        0.05, help="Seconds a ring entry stays pinned after the last request using it ends (a reuse meanwhile "
        "costs the encoder no message); a full ring gets its unpins at once."
    ),
    metrics: str = typer.Option("", help="HOST:PORT for Prometheus /metrics and /health (off when empty)."),
    keys_dir: str = typer.Option("", help=KEYS_HELP),
    insecure: bool = typer.Option(False, help=INSECURE_HELP),
    log_format: str = typer.Option("text", help="text or json"),
    log_requests: bool = typer.Option(True, help="One log line per request end (id, route, tokens, timings)."),
    log_level: str = typer.Option("info", help="debug adds a line per dispatch; warning keeps only trouble."),
    drain_timeout: float = typer.Option(
        30.0, help="On SIGTERM: seconds new requests are refused (busy) while those in flight finish; 0 stops "
        "at once. Ctrl-C or a second SIGTERM stops at once."
    ),
    cpus: str = typer.Option("", help=CPUS_HELP),
) -> None:
    """Run the broker."""
    from epdq.broker import BrokerConfig
    from epdq.launch import serve_broker

    if log_level not in ("debug", "info", "warning", "error"):
        raise typer.BadParameter("log level must be debug, info, warning or error")
    _setup_logging(log_level, log_format)
    try:
        cfg = BrokerConfig(
            address=address, max_queued_requests=max_queued, max_images_per_request=max_images,
            max_image_bytes=_mib(max_image_mb, "--max-image-mb"),
            max_held_image_bytes=_mib(max_held_image_mb, "--max-held-image-mb"),
            default_timeout_s=timeout, heartbeat_s=heartbeat,
            liveness=liveness, client_liveness_s=client_liveness, encode_lease_s=encode_lease,
            unpin_delay_s=unpin_delay, metrics_address=metrics, keys_dir=keys_dir, insecure=insecure, log_requests=log_requests,
            drain_timeout_s=drain_timeout, cpus=_cpu_list(cpus),
        )  # fmt: skip
    except ValueError as e:
        raise typer.BadParameter(_flag_names(str(e))) from None
    _run(serve_broker(cfg))


# config fields as the flags that set them, for the configs' error messages
_FLAGS = {
    "max_queued_requests": "--max-queued", "max_images_per_request": "--max-images", "default_timeout_s": "--timeout",
    "heartbeat_s": "--heartbeat", "liveness": "--liveness", "client_liveness_s": "--client-liveness",
    "encode_lease_s": "--encode-lease", "unpin_delay_s": "--unpin-delay", "drain_timeout_s": "--drain-timeout", "metrics_address": "--metrics",
    "max_image_bytes": "--max-image-mb (in bytes)", "max_held_image_bytes": "--max-held-image-mb (in bytes)", "fetch_bind": "--fetch-bind", "fetch_advertise": "--fetch-advertise",
    "allow_private_urls": "--allow-private-urls",
    "allow_remote_urls": "--allow-remote-urls", "request_timeout_s": "--timeout", "max_body_bytes": "--max-body-mb (in bytes)",
    "default_max_tokens": "--default-max-tokens", "log_format": "--log-format", "max_images": "--max-images",
    "share_by": "--share-by", "share_connections": "--share-connections", "max_model_len": "--max-model-len",
    "kv_cache_bytes": "--kv-cache-mb (in bytes)", "cpus": "--cpus", "max_batch": "--max-batch", "capacity": "--capacity",
    "role_options": "worker settings",
}  # fmt: skip


def _cpu_list(text: str) -> tuple[int, ...]:
    from epdq.cpus import parse_cpu_list

    return parse_cpu_list(text) if text else ()


def _role_cpus(items: list[str]) -> dict[str, str]:
    return _by_role(items, "--cpus", "ROLE=CPUS (e.g. broker=0 or pd=1-3)")


def _by_role(items: list[str], flag: str, form: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        role, eq, value = item.partition("=")
        if not eq or not role.strip():
            raise ValueError(f"{flag} takes {form}, got {item!r}")
        if role.strip() in out:
            raise ValueError(f"{flag} names the {role.strip()} twice")
        out[role.strip()] = value
    return out


def _role_options(capacity: list[str], max_batch: int) -> dict[str, dict[str, int]]:
    """`epdq up --capacity ROLE=N ... --max-batch N` as ClusterSpec.role_options."""
    out: dict[str, dict[str, int]] = {}
    for role, value in _by_role(capacity, "--capacity", "ROLE=N (e.g. encoder=32 or pd=8)").items():
        if not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"--capacity for the {role}: a whole number of jobs, at least 1, not {value!r}")
        out[role] = {"capacity": int(value)}
    if max_batch:
        out.setdefault("encoder", {})["max_batch"] = max_batch
    return out


def _flag_names(message: str) -> str:
    # a word already written as a flag ("--cpus takes ...") is left as it is
    return re.sub(r"(?<![\w-])[a-z_]+\b", lambda m: _FLAGS.get(m.group(0), m.group(0)), message)


@app.command()
def worker(
    role: str = typer.Option(..., help="encoder, pd, or both (colocated baseline)."),
    broker: str = typer.Option(DEFAULT_ADDRESS, help="Broker address."),
    model: str = typer.Option("", help="Checkpoint directory (default: the embedded tiny model)."),
    node: str = typer.Option("", help="Node id (default: hostname); same id = same shared-memory ring."),
    capacity: int = typer.Option(
        0, help="Jobs held at once, the worker's credit at the broker (0 = role default: pd and both 16, "
        "encoder twice --max-batch)."
    ),
    max_batch: int = typer.Option(
        0, help="Encoder: images per forward at most (0 = 8, or --capacity if smaller); the rest of its "
        "credit is the next batch, waiting."
    ),
    ring_mb: int = typer.Option(256, help="Encoder ring size, MiB."),
    dtype: str = typer.Option("auto", help="auto (bfloat16 on a GPU, float32 on the CPU), float32, bfloat16 or float16."),
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N: where the vision tower / the hf PD engine run."),
    ring: str = typer.Option(
        "auto", help="Encoder ring: auto (cuda on a GPU, else shm), shm (shared memory) or cuda (device memory)."
    ),
    fetch_bind: str = typer.Option(
        "", help="Encoder: where PD workers on other nodes fetch bytes (default: tcp on loopback with CURVE "
        "keys at hand, else a private ipc socket)."
    ),
    fetch_advertise: str = typer.Option(
        "", help="Encoder: HOST or tcp://HOST:PORT told to PD workers (default: the bound address; for a "
        "wildcard bind, the interface that routes to the broker)."
    ),
    threads: int = typer.Option(1, help="Encoder: torch threads for the vision forward."),
    max_model_len: int = typer.Option(
        4096, help="PD/both: tokens of one sequence (prompt with its image tokens, and output)."
    ),
    kv_cache_mb: int = typer.Option(
        0, help="PD/both, vLLM engine: KV cache, MiB; 0: 64 MiB on the CPU, vLLM's own sizing on a GPU "
        "(its gpu_memory_utilization share). One sequence of --max-model-len tokens must fit."
    ),
    engine: str = typer.Option("auto", help="auto (vision tower / vLLM), hf (transformers PD engine) or noop."),
    heartbeat: float = typer.Option(1.0, help="Heartbeat interval to the broker, seconds."),
    drain_timeout: float = typer.Option(
        30.0, help="On SIGTERM: seconds to finish the work in hand (the broker sends nothing new) before "
        "leaving; 0 leaves at once. Ctrl-C or a second SIGTERM stops at once."
    ),
    keys_dir: str = typer.Option("", help=KEYS_HELP),
    insecure: bool = typer.Option(False, help=INSECURE_HELP),
    log_format: str = typer.Option("text", help="text or json"),
    cpus: str = typer.Option("", help=CPUS_HELP.replace("this process", "this worker and what it starts (vLLM's engine)")),
) -> None:
    """Run one worker."""
    from epdq.launch import serve_worker
    from epdq.worker.runner import WorkerConfig

    _setup_logging("info", log_format, vllm=True)
    try:
        cfg = WorkerConfig(
            role=role, broker=broker, model=model, node=node, capacity=capacity, max_batch=max_batch, ring_bytes=ring_mb * 2**20,
            dtype=dtype, device=device, ring=ring, fetch_bind=fetch_bind, fetch_advertise=fetch_advertise, threads=threads, engine=engine,
            heartbeat_s=heartbeat, keys_dir=keys_dir, insecure=insecure, drain_timeout_s=drain_timeout,
            max_model_len=max_model_len, kv_cache_bytes=kv_cache_mb * 2**20, cpus=_cpu_list(cpus),
        )  # fmt: skip
    except ValueError as e:  # also DeviceUnavailableError: e.g. --device cuda:0 on a machine without CUDA
        raise typer.BadParameter(_flag_names(str(e))) from None
    try:
        _run(serve_worker(cfg))
    except EngineError as e:  # its engine died: status 1 for the supervisor (README), as under `epdq up`
        _say_fatal(e)
        raise typer.Exit(1) from None


@app.command()
def up(
    address: str = typer.Option(DEFAULT_ADDRESS, help="Broker address to serve on."),
    encoders: int = typer.Option(None, help="Encoder workers (default 1; none with --colocated)."),
    pds: int = typer.Option(1, help="PD workers (with --colocated: colocated workers)."),
    colocated: bool = typer.Option(
        False, "--colocated", help="The baseline: colocated workers only, no encoders."
    ),
    both: int = typer.Option(0, help="Colocated workers to run beside the disaggregated ones."),
    model: str = typer.Option("", help="Checkpoint directory (default: the embedded tiny model)."),
    log_dir: str = typer.Option("", help="Where child logs go (default: a temporary directory)."),
    keys_dir: str = typer.Option("", help=KEYS_HELP),
    insecure: bool = typer.Option(False, help=INSECURE_HELP),
    http: str = typer.Option("", help="HOST:PORT for the OpenAI-compatible gateway (off when empty)."),
    model_name: str = typer.Option("epdq", help="Model id the gateway advertises (with --http)."),
    allow_dir: str = typer.Option("", help="Gateway: serve local image files under this directory."),
    metrics: str = typer.Option("", help="HOST:PORT for the broker's Prometheus /metrics and /health."),
    log_format: str = typer.Option("text", help="Child logs: text or json"),
    restarts: int = typer.Option(5, min=0, help="Restarts of a process that keeps crashing; its next crash stops everything (0: the first crash does)."),
    drain_timeout: float = typer.Option(
        10.0, help="On Ctrl-C or SIGTERM: seconds to finish the requests in flight while new ones are refused "
        "(a second Ctrl-C stops at once)."
    ),
    max_model_len: int = typer.Option(
        4096, help="PD and colocated workers: tokens of one sequence (prompt with its image tokens, and output)."
    ),
    kv_cache_mb: int = typer.Option(
        0, help="PD and colocated workers, vLLM engine: KV cache, MiB; 0: 64 MiB on the CPU. One sequence of "
        "--max-model-len tokens must fit."
    ),
    cpus: list[str] = typer.Option(
        [], help="ROLE=CPUS, repeatable: the CPUs the broker's, the encoders', the PD workers', the colocated "
        "workers' or the HTTP gateway's processes run on (roles broker, encoder, pd, both, gateway; taskset -c syntax, e.g. --cpus broker=0 "
        "--cpus pd=1-3). Roles not named run wherever the kernel puts them."
    ),
    capacity: list[str] = typer.Option(
        [], help="ROLE=N, repeatable: jobs each worker of that role holds at once, its credit (roles encoder, pd, "
        "both; default: pd and both 16, encoders twice --max-batch)."
    ),
    max_batch: int = typer.Option(0, help="Encoders: images per forward at most (0 = 8, or their --capacity if smaller)."),
) -> None:
    """Start broker + workers (and optionally the HTTP gateway) on this machine; serve until Ctrl-C."""
    from epdq.cluster import Cluster, ClusterSpec

    if colocated:
        if encoders:  # it used to be dropped without a word
            raise typer.BadParameter("--colocated runs colocated workers only: drop --encoders")
        encoders, pds, both = 0, 0, max(pds, 1) + both
    elif encoders is None:
        encoders = 1
    http_options: dict = {"model_name": model_name}
    if allow_dir:
        http_options["allow_dir"] = allow_dir
    try:
        spec = ClusterSpec(
            address=address, encoders=encoders, pds=pds, both=both, model=model, log_dir=log_dir,
            keys_dir=keys_dir, insecure=insecure, metrics=metrics, http=http, http_options=http_options,
            log_format=log_format, drain_timeout_s=drain_timeout, cpus=_role_cpus(cpus),
            worker_defaults={"max_model_len": max_model_len, "kv_cache_bytes": kv_cache_mb * 2**20},
            role_options=_role_options(capacity, max_batch),
        )  # fmt: skip
        cluster = Cluster(spec)
        cluster.worker_configs()  # every setting checked before anything starts
    except ValueError as e:
        raise typer.BadParameter(_flag_names(str(e))) from None

    async def main() -> None:
        # SIGTERM (systemd, docker stop) stops like Ctrl-C: the broker drains first (Cluster.stop)
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
        started = False
        try:
            await cluster.start(progress=lambda m: typer.echo(f"  {m}"))
            started = True
            typer.echo(f"\nepdq is up. Connect to {address}   (logs: {cluster.log_dir})")
            if cluster.keys_dir:
                typer.echo(f"  CURVE keys: {cluster.keys_dir} (clients use client.key_secret and broker.key)")
            typer.echo(f'  epdq generate "Describe this." --image photo.png --address {address}')
            if cluster.http_url:
                typer.echo(f"  OpenAI-compatible API: {cluster.http_url}/v1  (model {model_name!r})")
            if metrics:
                typer.echo(f"  Prometheus: broker http://{metrics}/metrics, gateway {cluster.http_url}/metrics"
                           if cluster.http_url else f"  Prometheus: http://{metrics}/metrics")  # fmt: skip
            typer.echo("Ctrl-C stops everything.")
            await cluster.supervise(max_restarts=restarts, say=lambda m: typer.echo(f"  {m}"))
        finally:
            # asyncio.run's own handler takes the first Ctrl-C after a SIGTERM to cancel this
            # (already ending) task and swallows it: from here on Ctrl-C must cut the drain short
            signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                if started:
                    typer.echo(f"stopping: new requests are refused, those in flight finish (at most "
                               f"{drain_timeout:g} s; Ctrl-C again stops at once)")  # fmt: skip
                elif cluster.children:
                    typer.echo("stopping the processes started so far")
                cluster.stop()
            except KeyboardInterrupt:
                typer.echo("stopping now")
                cluster.stop(now=True)

    try:
        asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass
    except (RuntimeError, TimeoutError) as e:  # a child that failed to start or died: its log lines say why
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt."),
    image: list[Path] = typer.Option([], "--image", help="Image file (repeatable)."),
    address: str = typer.Option(DEFAULT_ADDRESS, "--address", "--broker", help="Broker address."),
    max_tokens: int = typer.Option(32),
    temperature: float = typer.Option(0.0),
    top_p: float = typer.Option(1.0),
    seed: int = typer.Option(None),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    route: str = typer.Option("auto", help="auto (E->PD when encoders and PD workers exist), epd or colocated."),
    timeout: float = typer.Option(None, help="Deadline in seconds (default: the broker's --timeout, 120 s)."),
    stream: bool = typer.Option(True, help="Print tokens as they arrive."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    keys_dir: str = typer.Option("", help=KEYS_HELP),
    insecure: bool = typer.Option(False, help=INSECURE_HELP),
) -> None:
    """Send one request and print the answer."""
    from epdq.client import AsyncClient

    async def main() -> int:
        async with AsyncClient(address, timeout=timeout, keys_dir=keys_dir, insecure=insecure) as c:
            kw = dict(images=image, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                      stop=stop, route=route)  # fmt: skip
            if stream and not as_json:
                printed = False
                try:
                    async for d in c.stream(prompt, **kw):
                        sys.stdout.write(d.text)
                        sys.stdout.flush()
                        printed = printed or bool(d.text)
                except BaseException:
                    if printed:  # the error line must not start mid-answer
                        sys.stdout.write("\n")
                        sys.stdout.flush()
                    raise
                sys.stdout.write("\n")
                return 0
            r = await c.generate(prompt, **kw)
            if as_json:
                t = r.timings
                typer.echo(json.dumps({"request_id": r.request_id, "text": r.text, "token_ids": r.token_ids,
                                       "finish_reason": r.finish_reason, "prompt_tokens": r.prompt_tokens,
                                       "timings": {s: getattr(t, s) for s in t.__slots__}}))  # fmt: skip
            else:
                typer.echo(r.text)
                typer.echo(
                    f"[{r.prompt_tokens} prompt + {len(r.token_ids)} tokens, TTFT {r.timings.ttft_s * 1e3:.1f} ms, "
                    f"{r.finish_reason}]",
                    err=True,
                )
            return 0

    try:
        raise typer.Exit(asyncio.run(main()))
    except EpdqError as e:
        typer.echo(f"error ({e.code}): {e.message}", err=True)
        raise typer.Exit(exit_code(e)) from None
    except ValueError as e:  # the client's own settings (--timeout)
        raise typer.BadParameter(str(e)) from None


@app.command()
def demo(
    address: str = typer.Option("tcp://127.0.0.1:7711", help="Broker address for the demo cluster."),
    model: str = typer.Option("", help="Checkpoint directory (default: the embedded tiny model)."),
    compare: bool = typer.Option(
        True, help="Also run each request on a colocated worker and compare tokens."
    ),
) -> None:
    """Start a cluster, send several multimodal requests, print outputs, TTFT and cache stats, stop."""
    from epdq.cluster import Cluster, ClusterSpec
    from epdq.demo import run_demo

    try:  # the settings, checked before anything starts
        Cluster(ClusterSpec(address=address, model=model, both=int(compare))).worker_configs()
    except ValueError as e:
        raise typer.BadParameter(_flag_names(str(e))) from None
    try:
        ok = asyncio.run(run_demo(address=address, model=model, compare=compare, out=typer.echo))
    except (RuntimeError, TimeoutError) as e:  # a process that failed to start: its log lines say why
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    raise typer.Exit(0 if ok else 1)


@app.command("make-model")
def make_model(
    out: Path = typer.Argument(None, help="Output directory (default: the embedded model's location)."),
    seed: int = typer.Option(0, help="Seed of the random weights (with OUT; the embedded model uses 0)."),
    overwrite: bool = typer.Option(False, help="Replace OUT if it holds a checkpoint epdq wrote (nothing else)."),
) -> None:
    """Write the tiny random Qwen2-VL checkpoint (real HF format) used when no --model is given."""
    from epdq.models.tiny import default_model_dir, write_tiny_checkpoint

    if out is None and (seed or overwrite):
        raise typer.BadParameter("--seed and --overwrite need OUT (the embedded model is always seed 0)")
    if not 0 <= seed < 2**63:
        raise typer.BadParameter(f"--seed must be in [0, 2**63), not {seed}")
    try:
        path = default_model_dir() if out is None else write_tiny_checkpoint(out, seed=seed, overwrite=overwrite)
    except OSError as e:  # a directory the user named that cannot be written: one line, exit 2
        raise ConfigError(f"cannot write the model to {out}: {_os_reason(e)}") from None
    typer.echo(str(path))


@app.command()
def stats(
    address: str = typer.Argument(DEFAULT_ADDRESS, help="Broker address."),
    broker: str = typer.Option(None, "--broker", "--address", help="Broker address (instead of ADDRESS)."),
    timeout: float = typer.Option(5.0),
    keys_dir: str = typer.Option("", help=KEYS_HELP),
    insecure: bool = typer.Option(False, help=INSECURE_HELP),
) -> None:
    """Print the broker's counters, gauges and workers as JSON."""
    from epdq.client import AsyncClient

    address = _one_address(address, broker)

    async def main() -> dict:
        async with AsyncClient(address, keys_dir=keys_dir, insecure=insecure) as c:
            return await c.stats(timeout=timeout)

    typer.echo(json.dumps(asyncio.run(main()), indent=2))


@app.command("serve-http")
def serve_http(
    broker: str = typer.Option(DEFAULT_ADDRESS, "--broker", "--address", help="Broker address."),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000),
    model_name: str = typer.Option("epdq", help="Model id advertised by /v1/models."),
    allow_dir: str = typer.Option("", help="Serve local image files under this directory (off when empty)."),
    allow_remote_urls: bool = typer.Option(False, help="Fetch http(s) image URLs (public addresses only)."),
    allow_private_urls: bool = typer.Option(
        False, help="With --allow-remote-urls: also from loopback, private and link-local addresses."
    ),
    max_body_mb: float = typer.Option(32.0, help="Largest request body (data: URLs travel in it)."),
    max_image_mb: float = typer.Option(
        20.0, help="Largest local or remote image file the gateway reads (the broker's --max-image-mb still applies)."
    ),
    max_images: int = typer.Option(8, help="Images per request, refused before any is read (as the broker's default)."),
    timeout: float = typer.Option(0.0, help="Request deadline, seconds (0: the broker's --timeout, 120 s)."),
    default_max_tokens: int = typer.Option(
        0, help="max_tokens of a request that names none; 0: as many as fit in the context (as vLLM)."
    ),
    share_by: str = typer.Option(
        "address", help="Spread users over broker connections, each with its own share of a full queue, by the "
        "request's address, its OpenAI 'user' field (the address where it names none), or 'none'.",
    ),
    share_connections: int = typer.Option(8, help="Broker connections the users are spread over (1..64)."),
    keys_dir: str = typer.Option("", help=KEYS_HELP),
    insecure: bool = typer.Option(False, help=INSECURE_HELP),
    log_format: str = typer.Option("text", help="text or json"),
    cpus: str = typer.Option("", help=CPUS_HELP),
) -> None:
    """OpenAI-compatible HTTP gateway (/v1/chat/completions, /v1/models, /health, /metrics)."""
    from epdq.gateway import GatewayConfig, run

    try:
        cfg = GatewayConfig(
            broker, host=host, port=port, model_name=model_name, allow_dir=allow_dir or None,
            allow_remote_urls=allow_remote_urls, allow_private_urls=allow_private_urls, max_body_bytes=_mib(max_body_mb, "--max-body-mb"),
            max_image_bytes=_mib(max_image_mb, "--max-image-mb"),
            max_images=max_images,
            request_timeout_s=timeout, default_max_tokens=default_max_tokens, keys_dir=keys_dir, insecure=insecure,
            share_by=share_by, share_connections=share_connections, log_format=log_format, cpus=_cpu_list(cpus),
        )  # fmt: skip
    except ValueError as e:
        raise typer.BadParameter(_flag_names(str(e))) from None
    run(cfg)


@app.command()
def status(
    address: str = typer.Argument(DEFAULT_ADDRESS, help="Broker address."),
    broker: str = typer.Option(None, "--broker", "--address", help="Broker address (instead of ADDRESS)."),
    once: bool = typer.Option(False, help="Print once and exit (default: refresh until Ctrl-C)."),
    as_json: bool = typer.Option(False, "--json", help="JSON (one object per refresh)."),
    interval: float = typer.Option(1.0, help="Seconds between refreshes."),
    keys_dir: str = typer.Option("", help=KEYS_HELP),
    insecure: bool = typer.Option(False, help=INSECURE_HELP),
) -> None:
    """Live table of workers, queues, ring usage and cache hit rate."""
    from epdq.status import show

    address = _one_address(address, broker)
    if not 0.1 <= interval <= 3600:  # also NaN
        raise typer.BadParameter(f"--interval must be 0.1..3600 seconds, not {interval}")
    try:
        asyncio.run(show(address, once=once, as_json=as_json, interval=interval, keys_dir=keys_dir, insecure=insecure))
    except KeyboardInterrupt:
        pass


@app.command()
def keygen(
    directory: Path = typer.Argument(None, help="Keys directory (default: $EPDQ_HOME/keys)."),
) -> None:
    """Write CURVE key pairs for broker, clients and workers, and the broker's allow-list."""
    from epdq.keys import ensure_cluster_keys

    try:
        d = ensure_cluster_keys(directory)
    except OSError as e:
        raise ConfigError(f"cannot write keys to {directory}: {_os_reason(e)}") from None
    typer.echo(f"keys in {d}: broker, client, worker (*.key public, *.key_secret private); allow-list {d}/allowed")
    typer.echo("Give clients client.key_secret + broker.key; workers worker.key_secret + broker.key.")


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: comparison tables, JSON and PNG plots.")
app.add_typer(bench_app, name="bench")


def _bench(module: str, argv: list[str], name: str | None = None) -> None:
    from epdq.benchmarks.suite import run_one

    raise typer.Exit(run_one(module, argv, name))


_PASS = {"context_settings": {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}}


@bench_app.command("handoff", **_PASS)
def bench_handoff(ctx: typer.Context) -> None:
    """Embedding hand-off: ring vs remote fetch vs safetensors files vs one memcpy (--help for options)."""
    _bench("handoff", ctx.args)


@bench_app.command("control", **_PASS)
def bench_control(ctx: typer.Context) -> None:
    """Control plane: broker + no-op workers vs an HTTP proxy shaped like vLLM's (--help for options)."""
    _bench("control", ctx.args)


@bench_app.command("goodput", **_PASS)
def bench_goodput(ctx: typer.Context) -> None:
    """Goodput under SLOs: 1 encoder + N PD vs N+1 colocated (--help for options)."""
    _bench("goodput", ctx.args)


@bench_app.command("scale", **_PASS)
def bench_scale(ctx: typer.Context) -> None:
    """The scheduler with 1,000 simulated workers and 100,000 queued requests (--help for options)."""
    _bench("scale", ctx.args)


@bench_app.command("all", **_PASS)
def bench_all(ctx: typer.Context) -> None:
    """Every benchmark into one folder, then their targets in one table (--help for options)."""
    _bench("suite", ctx.args, "all")


@bench_app.command("summary", **_PASS)
def bench_summary(ctx: typer.Context) -> None:
    """Every benchmark's targets in one table, from the JSON files the runs wrote (--help for options)."""
    _bench("summary", ctx.args)


def _os_reason(e: OSError) -> str:
    # mkdir(parents=True) reports a file in the way as "File exists", naming neither
    if isinstance(e, FileExistsError) and e.filename:
        return f"{e.filename} exists and is not a directory"
    if isinstance(e, NotADirectoryError) and e.filename:
        return f"{e.filename}: a part of this path is a file, not a directory"
    return f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)


def exit_code(e: EpdqError) -> int:
    """2: the command or its input is wrong (fix it); 3: the cluster could not serve it (busy,
    unreachable, past its deadline, a worker or engine failed: retrying may help)."""
    return 2 if isinstance(e, (ConfigError, InvalidInputError)) else 3


def _say_fatal(e: EpdqError) -> None:
    """The line saying why this process stops. Where the logs are JSON (--log-format json) it is
    one JSON object like theirs: a pipeline that parses them dropped the text line, this one of all."""
    import logging

    from epdq.logs import JsonFormatter

    formatter = next((h.formatter for h in logging.getLogger().handlers if isinstance(h.formatter, JsonFormatter)), None)
    if formatter is None:
        typer.echo(f"error ({e.code}): {e.message}", err=True)
        return
    typer.echo(_json_error(formatter, e.message, event="fatal", code=e.code), err=True)


def _json_error(formatter, message: str, **fields: str) -> str:
    """One error line as the process's JSON logs write theirs."""
    import logging

    record = logging.LogRecord("epdq", logging.ERROR, __file__, 0, message, None, None)
    record.__dict__.update(fields)
    return formatter.format(record)


def _json_logs_asked(argv: list[str]) -> bool:
    return "--log-format=json" in argv or any(
        a == "--log-format" and argv[i + 1 : i + 2] == ["json"] for i, a in enumerate(argv)
    )


def _run_app_for_json_logs() -> None:
    """As `app()`, but a usage error (a bad flag or value, exit 2) is one JSON object on stderr
    like every other line of a process asked for JSON logs, not a text box a log pipeline drops."""
    from typer.exceptions import TyperException

    from epdq.logs import JsonFormatter

    try:
        rc = app(standalone_mode=False)
    except typer.Abort:  # Ctrl-C outside a command's own handling, as click says it
        typer.echo("Aborted!", err=True)
        sys.exit(1)
    except TyperException as e:  # typer's own click: a usage error, a bad parameter
        if not hasattr(e, "format_message"):
            raise
        ctx = getattr(e, "ctx", None)
        where = {"command": ctx.command_path} if ctx is not None else {}
        typer.echo(_json_error(JsonFormatter(), e.format_message(), event="usage", code="usage", **where), err=True)
        sys.exit(getattr(e, "exit_code", 2))
    sys.exit(rc if isinstance(rc, int) else 0)


def main() -> None:
    try:
        if _json_logs_asked(sys.argv[1:]):
            _run_app_for_json_logs()
        else:
            app()
    except EpdqError as e:  # configuration problems, an unreachable broker: one clear line
        _say_fatal(e)
        sys.exit(exit_code(e))


if __name__ == "__main__":
    main()
