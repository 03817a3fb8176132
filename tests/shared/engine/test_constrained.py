"""Constrained decoding on the real model: outputs match their constraint (JSON schemas,
any JSON object, regexes, choices, grammars), greedy and seeded, and a request resumed
from its tokens so far (a failover, a first token from prefill) continues exactly as it
would have."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from shared.config import PreemptionSetting
from shared.engine.constraint import Constraint
from shared.engine.sampling_params import SamplingParams
from shared.errors import InvalidRequestError
from tests.conftest import EngineFactory

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def chat(make_engine: EngineFactory, text: str) -> list[int]:
    return make_engine().tokenizer.encode_chat([{"role": "user", "content": text}])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=80, temperature=0),
        SamplingParams(max_tokens=80, temperature=0.8, seed=5),
    ],
    ids=["greedy", "seeded"],
)
def test_json_schema_outputs_validate(make_engine: EngineFactory, params: SamplingParams) -> None:
    engine = make_engine()
    prompt = chat(make_engine, "Describe a person who lives in a European capital, as JSON.")
    c = Constraint.json_schema(PERSON)
    done = engine.generate([prompt], SamplingParams(**{**params.__dict__, "constraint": c}))[0]
    assert done.finish_reason.value == "stop"
    jsonschema.validate(json.loads(done.text), PERSON)


def test_json_object_regex_choice_and_grammar(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prompt = chat(make_engine, "Answer the question: is Paris in France?")
    cases = {
        Constraint.json_object(): lambda t: isinstance(json.loads(t), dict),
        Constraint.regex(r"(yes|no), [a-z ]{3,20}\."): lambda t: re.fullmatch(
            r"(yes|no), [a-z ]{3,20}\.", t
        ),
        Constraint.choice(["yes", "no", "it depends"]): lambda t: t in ("yes", "no", "it depends"),
        Constraint.grammar('start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'): (
            lambda t: t in ("The answer is yes.", "The answer is no.")
        ),
    }
    for constraint, ok in cases.items():
        params = SamplingParams(
            max_tokens=40, temperature=0, ignore_eos=True, constraint=constraint
        )
        done = engine.generate([prompt], params)[0]
        assert ok(done.text), (constraint.kind, done.text)
        # the grammar ended the output, even with ignore_eos
        assert done.finish_reason.value == "stop", (constraint.kind, done.text)


def test_a_resumed_request_continues_token_exact(make_engine: EngineFactory) -> None:
    """Decode after prefill, or a failover: the grammar is rebuilt from the constraint
    and replayed over the tokens so far; greedy and seeded outputs continue as in one
    run."""
    engine = make_engine()
    prompt = chat(make_engine, "Describe a person as JSON.")
    for params in (
        SamplingParams(max_tokens=60, temperature=0, constraint=Constraint.json_schema(PERSON)),
        SamplingParams(
            max_tokens=60, temperature=0.9, seed=9, constraint=Constraint.json_schema(PERSON)
        ),
    ):
        whole = engine.generate([prompt], params)[0].token_ids
        for cut in (1, 7, len(whole) // 2):
            req = engine.new_request(prompt, params, seed=params.seed or 0)
            if params.seed is None:  # greedy: the seed does not matter
                req.seed = 0
            rid = engine.add(req, generated=whole[:cut], detokenize=False)
            tokens: list[int] = []
            while engine.has_unfinished():
                for out in engine.step():
                    if out.request_id == rid:
                        tokens += out.new_token_ids
            assert whole[:cut] + tokens == whole


@pytest.mark.parametrize("max_tokens", [12, 30, 75])
def test_a_json_object_closes_within_max_tokens(
    make_engine: EngineFactory, max_tokens: int
) -> None:
    """The default model repeats array items until any budget runs out: the object is
    closed in its last tokens instead (finish_reason "length" all the same), the same
    tokens when the request resumes from any point, seeded too."""
    engine = make_engine()
    prompt = chat(make_engine, "Describe a city as a JSON object.")
    for params in (
        SamplingParams(max_tokens=max_tokens, temperature=0, constraint=Constraint.json_object()),
        SamplingParams(
            max_tokens=max_tokens, temperature=0.7, seed=3, constraint=Constraint.json_object()
        ),
    ):
        done = engine.generate([prompt], params)[0]
        assert isinstance(json.loads(done.text), dict), done.text
        assert len(done.token_ids) <= max_tokens
        if params.greedy:  # the greedy answer repeats itself: cut, and closed
            assert done.finish_reason.value == "length"
        n = len(done.token_ids)
        for cut in sorted({1, n - 3, n - 1} & set(range(1, n))):
            req = engine.new_request(prompt, params, seed=params.seed or 0)
            rid = engine.add(req, generated=done.token_ids[:cut], detokenize=False)
            tokens: list[int] = []
            while engine.has_unfinished():
                for out in engine.step():
                    if out.request_id == rid:
                        tokens += out.new_token_ids
            assert done.token_ids[:cut] + tokens == done.token_ids


def test_tokens_that_break_the_constraint_are_refused(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prompt = chat(make_engine, "Hi")
    params = SamplingParams(max_tokens=10, temperature=0, constraint=Constraint.choice(["yes"]))
    req = engine.new_request(prompt, params)
    with pytest.raises(InvalidRequestError, match="do not match"):
        engine.add(req, generated=engine.tokenizer.encode("no", add_special_tokens=False))


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint("json_schema", '{"type": "strang"}'), "strang"),
        (Constraint("json_schema", "{not json"), "invalid json_schema"),
        (Constraint("regex", "(unclosed"), "invalid regex"),
        (Constraint("choice", "[]"), "choice"),
        (Constraint("grammar", "start: missing_rule"), "missing_rule"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_before_compute(
    make_engine: EngineFactory, constraint: Constraint, message: str
) -> None:
    engine = make_engine()
    params = SamplingParams(max_tokens=10, constraint=constraint)
    with pytest.raises(InvalidRequestError, match=message):
        engine.new_request([1, 2, 3], params)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_constrained_requests_keep_their_tokens(
    make_engine: EngineFactory, mode: PreemptionSetting
) -> None:
    """Swapped out and back, or recomputed: the matcher stays with the request and the
    outputs (json_object closing in time included) are those of an unpressed run."""
    engine = make_engine()
    topics = ["a city", "a river", "a film", "a cat", "a car", "a song", "a tree", "a book"]
    prompts = [chat(make_engine, f"Describe {t} as a JSON object.") for t in topics]
    constraints = [Constraint.json_object(), Constraint.json_schema(PERSON)]
    params = [
        SamplingParams(
            max_tokens=48, temperature=0.8 if i % 2 else 0, seed=i, constraint=constraints[i % 2]
        )
        for i in range(len(prompts))
    ]
    reference = engine.generate(prompts, params)
    # 20 blocks of 16 tokens cannot hold all 8 sequences at once
    tight = make_engine(kv_cache_bytes=20 * 46_080 * 16, preemption_mode=mode)
    out = tight.generate(prompts, params)
    assert [o.token_ids for o in out] == [r.token_ids for r in reference]
    assert tight.snapshot().preemptions > 0
    for o in out:
        assert isinstance(json.loads(o.text), dict), o.text
