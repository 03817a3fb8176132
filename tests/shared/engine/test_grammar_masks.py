"""Masks computed beside the forward pass equal the ones sampling computes itself."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.engine.constraint import Constraint
from shared.engine.grammar import GrammarCompiler
from shared.engine.grammar_masks import MaskWorker, allowed_tokens
from shared.engine.request import RequestId
from shared.engine.sampler import SamplingRow, sample
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
    worker = MaskWorker(vocab)
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
            mask = pending.result()[RequestId("r")]
            assert torch.equal(mask, allowed_tokens([inline], vocab)[0])
            a = sample(logits, [SamplingRow(params, 0, 0, (), ahead, mask)])[0].token_id
            b = sample(logits, [SamplingRow(params, 0, 0, (), inline)])[0].token_id
            assert a == b and mask[a]
            assert ahead.accept(a) and inline.accept(b)
        assert worker.start({}) is None
    finally:
        worker.close()
