"""Token sampling: penalties, logit bias, temperature, top-k, top-p, seeded randomness, logprobs.

Randomness is keyed by ``(request seed, token position)`` only, never by a
running generator state: regenerating from any position (after preemption,
or on another instance after a failover) draws the same number and so the
same tokens. A sampled token is the one whose slice of the cumulative
distribution holds that key's uniform draw, computed on the CPU so the device
does not change it. Logprobs are the model's raw distribution (before
penalties and temperature), as vLLM reports them by default.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import xxhash

from shared.engine.grammar_masks import allowed_token_ids
from shared.engine.request import SampledToken, TokenLogprobs
from shared.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shared.engine.grammar import Matcher


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    seed: int
    position: int  # absolute position the sampled token will take in the sequence
    output_token_ids: Sequence[int]
    matcher: Matcher | None = None  # the row's grammar, when its output is constrained
    allowed: torch.Tensor | None = None  # the token ids its grammar allows, if known already


def _allowed_ids(rows: Sequence[SamplingRow]) -> dict[int, torch.Tensor]:
    """The constrained rows' allowed token ids, by row index: prepared beside the
    forward pass, else computed now. Sampling among them in token order is sampling
    from the masked logits (argmax keeps the lowest id among equals either way); a
    grammar that allows nothing leaves its row unmasked, and the token it samples is
    then refused by the matcher."""
    index = [i for i, r in enumerate(rows) if r.matcher is not None]
    missing = [i for i in index if rows[i].allowed is None]
    computed = allowed_token_ids([rows[i].matcher for i in missing]) if missing else []  # type: ignore[misc]
    found = dict(zip(missing, computed, strict=True))
    out = {}
    for i in index:
        ids = found[i] if i in found else rows[i].allowed
        if ids is not None and ids.numel():
            out[i] = ids
    return out


def noise_key(seed: int, position: int) -> int:
    """Stable 63-bit generator seed for one (request seed, token position)."""
    data = struct.pack("<QQ", seed % (1 << 64), position)
    return xxhash.xxh64_intdigest(data) & ((1 << 63) - 1)


def uniform(seed: int, position: int) -> float:
    """A stable draw in [0, 1) for one (request seed, token position): 53 bits of the
    key, a double's whole mantissa."""
    return (noise_key(seed, position) >> 10) / float(1 << 53)


def draw(probs: torch.Tensor, u: float) -> int:
    """The token whose slice of the cumulative distribution holds ``u`` in [0, 1)
    (inverse-CDF sampling: one uniform per token, where a race of exponentials drew one
    per vocabulary entry, ~750 us on a CPU core for 49k tokens against ~50 us here).
    A token of probability 0 owns an empty slice and is never drawn."""
    cdf = torch.cumsum(probs.to(torch.float64), 0)
    x = torch.tensor([u * float(cdf[-1])], dtype=torch.float64)
    token = int(torch.searchsorted(cdf, x, right=True))
    if token >= probs.numel():  # u * total rounded up to the total itself
        token = int(torch.nonzero(probs).max())
    return token


def apply_penalties(logits: torch.Tensor, params: SamplingParams, outputs: Sequence[int]) -> None:
    """OpenAI presence/frequency penalties over the generated tokens (in place)."""
    if not outputs:
        return
    counts = torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=logits.shape[-1])
    counts = counts[: logits.shape[-1]].to(logits.device, logits.dtype)
    logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def apply_logit_bias(logits: torch.Tensor, params: SamplingParams) -> None:
    """OpenAI ``logit_bias``: a value added to each listed token's logit (in place)."""
    vocab = logits.shape[-1]
    for token, bias in params.logit_bias:
        if token < vocab:
            logits[token] += bias


def filter_top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def _logprobs(raw: torch.Tensor, token: int, n: int) -> TokenLogprobs:
    top: tuple[tuple[int, float], ...] = ()
    if n > 0:
        vals, ids = torch.topk(raw, n)
        top = tuple(zip(ids.tolist(), vals.tolist(), strict=True))
    return TokenLogprobs(token_id=token, logprob=float(raw[token]), top=top)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
    """``logits``: fp32 ``[len(rows), vocab]`` -> one token per row."""
    raw = None
    if any(r.params.logprobs is not None for r in rows):
        raw = torch.log_softmax(logits, dim=-1).cpu()
    # one argmax over the batch for the plain greedy rows (per row it cost ~65 us each)
    plain = [r.params.greedy and not r.params.adjusts_logits for r in rows]
    best = torch.argmax(logits, dim=-1).tolist() if any(plain) else []
    allowed = _allowed_ids(rows)
    out: list[SampledToken] = []
    for i, row in enumerate(rows):
        p = row.params
        lg = logits[i]
        if p.has_penalties or p.logit_bias:
            lg = lg.clone()
            if p.has_penalties:
                apply_penalties(lg, p, row.output_token_ids)
            apply_logit_bias(lg, p)
        ids = allowed.get(i)
        if ids is not None:  # only the tokens the grammar allows, in token order
            lg = lg[ids.to(lg.device)]
        if plain[i]:
            token = best[i]
        elif p.greedy:
            token = int(torch.argmax(lg))
        else:
            lg = filter_top_k_top_p(lg / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(lg, dim=-1).cpu()
            token = draw(probs, uniform(row.seed, row.position))
        if ids is not None:
            token = int(ids[token])
        if row.matcher is not None:  # a json_object that must close to fit max_tokens
            token = row.matcher.within_budget(token)
        lp = None if raw is None or p.logprobs is None else _logprobs(raw[i], token, p.logprobs)
        out.append(SampledToken(token, lp))
    return out
