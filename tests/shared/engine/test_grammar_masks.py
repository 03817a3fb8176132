"""Masks computed beside the forward pass equal the ones sampling computes itself, and
sampling among a grammar's allowed ids equals sampling from the masked logits."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.engine.constraint import Constraint
from shared.engine.grammar import GrammarCompiler
from shared.engine.grammar_masks import MaskWorker, allowed_token_ids
from shared.engine.request import RequestId
from shared.engine.sampler import SamplingRow, draw, sample, uniform
from shared.engine.sampling_params import SamplingParams
from shared.model.tokenizer_loader import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "tag": {"enum": ["a", "b"]}},
    "required": ["n", "tag"],
    "additionalProperties": False,
}


def test_worker_masks_match_and_steer_sampling(cache_dir: Path) -> None:
    model = load_tokenizer(None, cache_dir=cache_dir)
    vocab, tok = model.arch.vocab_size, model.tokenizer
    compiler = GrammarCompiler(tok.to_json(), vocab, tok.eos_token_ids)
    constraint = Constraint.json_schema(SCHEMA)
    worker = MaskWorker()
    try:
        ahead = compiler.matcher(constraint)
        inline = compiler.matcher(constraint)
        logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0))
        params = SamplingParams(temperature=0, constraint=constraint, max_tokens=32)
        for _ in range(64):  # integers may run long; a few dozen steps cover the schema
            if ahead.done:
                break
            pending = worker.start({RequestId("r"): ahead})
            assert pending is not None
            ids = pending.result()[RequestId("r")]
            assert torch.equal(ids, allowed_token_ids([inline])[0])
            a = sample(logits, [SamplingRow(params, 0, 0, (), ahead, ids)])[0].token_id
            b = sample(logits, [SamplingRow(params, 0, 0, (), inline)])[0].token_id
            masked = torch.full_like(logits, float("-inf"))
            masked[0, ids] = logits[0, ids]
            assert a == b == int(torch.argmax(masked))
            assert ahead.accept(a) and inline.accept(b)
        assert worker.start({}) is None
        # seeded: the draw among the allowed ids is the draw from the masked softmax
        seeded = SamplingParams(temperature=0.7, seed=5, constraint=constraint, max_tokens=32)
        fresh = compiler.matcher(constraint)
        ids = allowed_token_ids([fresh])[0]
        masked = torch.full_like(logits, float("-inf"))
        masked[0, ids] = logits[0, ids]
        for position in range(20):
            got = sample(logits, [SamplingRow(seeded, 5, position, (), fresh, ids)])[0]
            probs = torch.softmax(masked[0] / 0.7, dim=-1)
            assert got.token_id == draw(probs, uniform(5, position))
    finally:
        worker.close()
