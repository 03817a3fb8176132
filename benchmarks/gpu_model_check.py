"""The engine on a CUDA device, in one process (the model-level half of
``benchmarks/gpu_check.py``):

- ``transformers``: greedy ids of our engine on CUDA against transformers on CUDA
  (fp32: both exact up to rounding; bf16 reported too: different kernels round
  differently, so greedy paths may part after a while);
- ``invariance``: with the kernels an engine picks on CUDA (Triton) and with the
  torch ones (cuBLAS, SDPA), whether a request's tokens and logprobs change with its
  batch, and whether a prefill over tokens decode computed continues bitwise;
- ``graphs``: one decode step's forward, eager against a CUDA graph replay of it, at
  batch 1, 8 and 32: whether capturing decode steps would pay.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shared.config import AttentionBackend, CacheConfig, DType, EngineConfig, LinearBackend
from shared.engine.engine import Engine
from shared.engine.model_runner import LayerHook, ModelInput, build_input
from shared.engine.request import RequestId, SampledToken
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler_output import SchedulerOutput
from shared.model.loader import LoadedModel, load_model

# another device only to rehearse the check where there is no GPU
DEVICE = os.environ.get("BATON_CHECK_DEVICE", "cuda")
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers and say why they are prime.",
]


def load(cache_dir: Path, dtype: str, **backends: Any) -> LoadedModel:
    return load_model(
        None, cache_dir=cache_dir, dtype=dtype, device=DEVICE, progress=False, **backends
    )


def engine(loaded: LoadedModel, attention: AttentionBackend = "auto") -> Engine:
    dtype: DType = "bfloat16" if loaded.model.dtype is torch.bfloat16 else "float32"
    cache = CacheConfig(kv_cache_bytes=512 << 20, enable_prefix_caching=False, prefault=False)
    config = EngineConfig(dtype=dtype, device=DEVICE, attention=attention, cache=cache)
    return Engine(loaded, config)


def backends(e: Engine) -> dict[str, str]:
    m = e.loaded.model
    a = e.runner.attention
    return {"linear": m.gemm.name, "pointwise": m.ops.name, "decode": a.decode.name,
            "prefill": a.prefill.name}  # fmt: skip


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def transformers_check(cache_dir: Path, max_tokens: int = 64) -> dict[str, Any]:
    import transformers

    out: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        loaded = load(cache_dir, dtype)
        ours = engine(loaded)
        hf: Any = transformers.AutoModelForCausalLM.from_pretrained(
            str(loaded.folder), dtype=getattr(torch, dtype)
        )
        hf = hf.to(DEVICE).eval()
        rows = []
        for text in CHATS:
            prompt = ours.tokenizer.encode_chat([{"role": "user", "content": text}])
            params = SamplingParams(max_tokens=max_tokens, temperature=0)
            got = ours.generate([prompt], params)[0].token_ids
            want, ref_logits = hf_greedy(hf, prompt, max_tokens, ours.tokenizer.eos_token_ids)
            logits = prompt_logits(ours, prompt)
            rows.append({
                "prompt": text, "equal": got == want,
                "first_difference": first_difference(got, want),
                "ours": ours.tokenizer.decode(got), "transformers": ours.tokenizer.decode(want),
                "last_logits_max_abs_diff": float((logits - ref_logits).abs().max()),
            })  # fmt: skip
        out[dtype] = {"backends": backends(ours), "all_equal": all(r["equal"] for r in rows),
                      "prompts": rows}  # fmt: skip
        del hf, ours, loaded
        torch.cuda.empty_cache()
    out["ok"] = out["float32"]["all_equal"]
    return out


def hf_greedy(
    hf: Any, prompt: list[int], max_tokens: int, eos: Sequence[int]
) -> tuple[list[int], torch.Tensor]:
    """Transformers' own incremental greedy decoding (its KV cache), up to and with the
    end-of-sequence token as the engine reports it; and the prompt's last logits."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt], device=DEVICE), use_cache=True)
        first = out.logits[0, -1].float()
        tokens: list[int] = []
        logits = first
        while len(tokens) < max_tokens:
            tokens.append(int(torch.argmax(logits)))
            if tokens[-1] in eos:
                break
            step = torch.tensor([[tokens[-1]]], device=DEVICE)
            out = hf(step, past_key_values=out.past_key_values, use_cache=True)
            logits = out.logits[0, -1].float()
    return tokens, first


def prompt_logits(e: Engine, prompt: list[int]) -> torch.Tensor:
    """The logits of the prompt's last position, as the engine computes them."""
    seen: list[torch.Tensor] = []
    forward = e.runner.model.forward

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        logits = forward(*args, **kwargs)
        seen.append(logits[-1].float().clone())
        return logits

    e.runner.model.forward = spy  # type: ignore[method-assign]
    try:
        e.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    finally:
        del e.runner.model.forward
    return seen[0]


def _prompts(e: Engine) -> list[list[int]]:
    text = "The history of the Roman Empire spans centuries of conquest, engineering and law. "
    base = e.tokenizer.encode(text * 40)
    return [base[: 50 + 61 * i] for i in range(8)]


def invariance_of(e: Engine, max_tokens: int = 48) -> dict[str, Any]:
    prompts = _prompts(e)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    alone = [e.generate([p], params)[0] for p in prompts]
    together = e.generate(prompts, params)
    batch_ids = sum(a.token_ids != b.token_ids for a, b in zip(alone, together, strict=True))
    batch_lp = sum(
        [x.logprob for x in a.logprobs] != [x.logprob for x in b.logprobs]
        for a, b in zip(alone, together, strict=True)
    )
    resumed_ids = resumed_lp = cases = 0
    for first, prompt in zip(alone[:4], prompts[:4], strict=True):
        for cut in (7, 23, 40):
            cases += 1
            rest = SamplingParams(
                max_tokens=max_tokens - cut, temperature=0, ignore_eos=True, logprobs=0
            )
            again = e.generate([prompt + first.token_ids[:cut]], rest)[0]
            resumed_ids += again.token_ids != first.token_ids[cut:]
            resumed_lp += [x.logprob for x in again.logprobs] != [
                x.logprob for x in first.logprobs[cut:]
            ]
    return {
        "backends": backends(e),
        "requests": len(prompts),
        "batched_vs_alone": {"ids_differ": batch_ids, "logprobs_differ": batch_lp},
        "prefill_after_decode": {"cases": cases, "ids_differ": resumed_ids,
                                 "logprobs_differ": resumed_lp},
        "invariant": batch_lp == 0 and resumed_lp == 0 and batch_ids == 0 and resumed_ids == 0,
    }  # fmt: skip


def invariance_check(cache_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    configs: list[tuple[str, LinearBackend, AttentionBackend]] = [
        ("triton", "auto", "auto"),
        ("torch", "torch", "torch"),
    ]
    for name, linear, attention in configs:
        for dtype in ("bfloat16", "float32"):
            loaded = load(cache_dir, dtype, linear=linear, pointwise=linear)
            out[f"{name}_{dtype}"] = invariance_of(engine(loaded, attention))
            del loaded
            torch.cuda.empty_cache()
    out["ok"] = out["triton_bfloat16"]["invariant"] and out["triton_float32"]["invariant"]
    return out


def decode_input(e: Engine, batch: int, context: int) -> ModelInput:
    """The model input of a step in which ``batch`` requests of ``context`` tokens decode
    (taken as the engine runs it; running it again rewrites the same K/V)."""
    rng = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        prompt = torch.randint(1000, 30000, (context,), generator=rng).tolist()
        e.add_request(prompt, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    taken: list[ModelInput] = []
    execute = e.runner.execute

    def spy(
        step: SchedulerOutput, on_layer: LayerHook | None = None
    ) -> dict[RequestId, SampledToken]:
        if len(step.scheduled) == batch and all(s.num_new_tokens == 1 for s in step.scheduled):
            taken.append(build_input(step, e.runner.block_size, DEVICE, split_decodes=False))
        return execute(step, on_layer)

    e.runner.execute = spy  # type: ignore[method-assign]
    try:
        while not taken:
            e.step()
    finally:
        del e.runner.execute
    return taken[0]


def graph_check(cache_dir: Path, context: int = 512, iters: int = 50) -> dict[str, Any]:
    loaded = load(cache_dir, "bfloat16")
    rows = []
    for batch in (1, 8, 32):
        e = engine(loaded)
        inp = decode_input(e, batch, context)
        runner, model = e.runner, e.runner.model

        def forward(inp: Any = inp, runner: Any = runner, model: Any = model) -> torch.Tensor:
            return model.forward(inp.input_ids, inp.positions, inp.meta, runner.kv_cache,
                                 inp.logits_rows, runner.attention)  # fmt: skip

        for _ in range(3):
            forward()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            forward()
        torch.cuda.synchronize()
        eager = (time.perf_counter() - t0) / iters
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = forward()
        replayed_equal = True
        want = forward().clone()
        graph.replay()
        torch.cuda.synchronize()
        replayed_equal = bool(torch.equal(captured, want))
        t0 = time.perf_counter()
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
        replay = (time.perf_counter() - t0) / iters
        rows.append({"batch": batch, "context": context, "eager_ms": eager * 1e3,
                     "graph_ms": replay * 1e3, "speedup": eager / replay,
                     "graph_output_equal": replayed_equal})  # fmt: skip
        del e, graph
        torch.cuda.empty_cache()
    return {"ok": True, "decode_forward": rows}
