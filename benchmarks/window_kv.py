"""KV memory a long request holds with sliding-window layers kept to their window, against
every layer keeping every block (``--sliding-window-kv`` off: what a Llama-style cache
holds), in one run on the real model.

For each context length one request is prefilled and decodes a few tokens alone in
the engine; while it decodes, the slots it references (``num_slots - num_free``, the
pool's own accounting) times the slot size are its KV memory. Printed beside it:
what the window implies (full-attention layers over the whole context, sliding
layers over their window only), the same counted in whole blocks (the blocks that
hold the tokens each layer's next row reads), and how many such requests the pool
holds at once.
Then the decode step time of 8 requests at once in both layouts, so the window's
bookkeeping cost is measured too.

    python -m benchmarks.window_kv                       # gemma3-270m, bf16
    python -m benchmarks.window_kv --lengths 1024 4096 8192
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from shared.config import CacheConfig, DType, EngineConfig, SchedulerConfig
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.kv.kv_cache import KVCache
from shared.model.loader import LoadedModel, load_model

MB = 1e6


@dataclass(frozen=True)
class Held:
    context: int
    held_bytes: int
    ideal_bytes: int  # what the window implies, to the token
    block_bytes: int  # the same in whole blocks: those holding the tokens each layer reads


def prompt(loaded: LoadedModel, n: int) -> list[int]:
    text = " ".join(f"Entry {i}: a traveller crossed river {i} at dawn." for i in range(n // 8))
    ids = loaded.tokenizer.encode(text)
    if len(ids) < n:
        raise SystemExit(f"the filler text gives {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def engine(loaded: LoadedModel, dtype: DType, windowed: bool, kv_bytes: int) -> Engine:
    config = EngineConfig(
        dtype=dtype,
        cache=CacheConfig(
            kv_cache_bytes=kv_bytes,
            sliding_window_kv=windowed,
            enable_prefix_caching=False,
            swap_space_bytes=0,
        ),
        scheduler=SchedulerConfig(max_num_batched_tokens=2048),
    )
    return Engine(loaded, config)


def held(loaded: LoadedModel, eng: Engine, n: int, decode: int = 8) -> Held:
    """The slots one request of ``n`` prompt tokens references after ``decode`` tokens."""
    params = SamplingParams(max_tokens=decode + 4, temperature=0, ignore_eos=True)
    eng.add_request(prompt(loaded, n), params)
    produced = 0
    while produced < decode:
        produced += len(eng.step())
    slot_bytes = KVCache.slot_bytes(eng.layout, eng.kv_cache.groups)
    used = (eng.kv.num_slots - eng.kv.num_free) * slot_bytes
    while eng.has_unfinished():
        eng.step()
    context = n + decode
    arch, per_token = loaded.arch, eng.layout.bytes_per_token // loaded.arch.num_layers
    bs = eng.layout.block_size
    ideal = blocks = 0
    for i in range(arch.num_layers):
        window = arch.window(i)
        ideal += per_token * (context if window is None else min(context, window))
        first = 0 if window is None else max(0, context - window) // bs  # next row's first
        blocks += per_token * bs * (-(-context // bs) - first)
    return Held(context, used, ideal, blocks)


def decode_step_ms(loaded: LoadedModel, eng: Engine, n: int, batch: int, steps: int) -> float:
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    ids = {eng.add_request(prompt(loaded, n + i), params) for i in range(batch)}
    decoding: set[str] = set()
    while decoding != ids:  # every request past its prompt
        decoding |= {o.request_id for o in eng.step() if o.num_output_tokens >= 2}
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    while eng.has_unfinished():
        eng.step()
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batch-context", type=int, default=2048)
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "baton")
    args = ap.parse_args()
    loaded = load_model(args.model, cache_dir=args.cache_dir, dtype=args.dtype, progress=False)
    kv_bytes = int(args.kv_cache_gb * (1 << 30))
    engines = {w: engine(loaded, args.dtype, w, kv_bytes) for w in (False, True)}
    print(f"model {args.model} {args.dtype}; pool {args.kv_cache_gb} GiB")
    for w, eng in engines.items():
        print(f"  {'window' if w else 'full  '}: {eng.kv_cache.groups.describe()}")
    print(
        f"{'context':>8} {'full MB':>9} {'window MB':>10} {'implied MB':>11} "
        f"{'in blocks MB':>13} {'window/implied':>15} {'full/window':>12} "
        f"{'fit full':>9} {'fit window':>11}"
    )
    for n in args.lengths:
        full = held(loaded, engines[False], n)
        win = held(loaded, engines[True], n)
        fit = {w: int(kv_bytes // max(1, h.held_bytes)) for w, h in ((False, full), (True, win))}
        print(
            f"{win.context:>8} {full.held_bytes / MB:>9.1f} {win.held_bytes / MB:>10.1f} "
            f"{win.ideal_bytes / MB:>11.1f} {win.block_bytes / MB:>13.1f} "
            f"{win.held_bytes / win.ideal_bytes:>15.3f} "
            f"{full.held_bytes / win.held_bytes:>12.2f} {fit[False]:>9} {fit[True]:>11}"
        )
    print(f"decode step, {args.batch} requests of ~{args.batch_context} tokens (median of 16):")
    for w, eng in engines.items():
        ms = decode_step_ms(loaded, eng, args.batch_context, args.batch, 16)
        print(f"  {'window' if w else 'full  '}: {ms:.2f} ms")


if __name__ == "__main__":
    main()
