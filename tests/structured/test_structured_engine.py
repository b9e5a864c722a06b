"""Structured outputs in the engine on a tiny random model: whatever the weights, the grammar makes
every output parse and validate and finish; n > 1 samples each follow their own matcher; a plain
greedy request batched with constrained ones keeps its output; bad constraints queue nothing."""

import json

import jsonschema
import pytest

from servescope import LLM, SamplingParams
from servescope.config import StructuredOutput
from servescope.errors import InvalidParameterError

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["kind", "n", "tags"],
          "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 4}}}}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path_factory.mktemp("so"), "llama_plain")
    return LLM(model=str(path), num_kv_blocks=128, max_model_len=512)


def test_random_model_json_always_valid_and_finished(llm):
    sp = SamplingParams(n=6, temperature=1.0, seed=5, max_tokens=120,
                        structured=StructuredOutput("json", json.dumps(SCHEMA)))
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = list(range(100, 120))
    alone = llm.generate([prompt], plain)[0].outputs[0].token_ids
    outs = llm.generate([list(range(10, 30)), prompt], [sp, plain])
    for o in outs[0].outputs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs[0].outputs}) > 1  # each sample has its own matcher and seed
    assert outs[1].outputs[0].token_ids == alone
    recs = list(llm.engine.step_records)
    assert any(r.grammar_mask_seconds > 0 for r in recs)


@pytest.mark.parametrize("spec", [StructuredOutput("choice", ("left", "right")),
                                  StructuredOutput("regex", "[a-c]{2}-[0-9]"),
                                  StructuredOutput("grammar", 'root ::= "x" ("y" | "z")+ "."'),
                                  StructuredOutput("json_object")])
def test_other_constraints(llm, spec):
    import re

    o = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.7, seed=1, max_tokens=60, structured=spec))[0].outputs[0]
    if spec.kind == "choice":
        assert o.text in spec.spec
    elif spec.kind == "regex":
        assert re.fullmatch(spec.spec, o.text)
    elif spec.kind == "grammar":
        assert re.fullmatch(r"x[yz]+\.", o.text)
    elif o.finish_reason == "stop":
        assert isinstance(json.loads(o.text), dict)


@pytest.mark.parametrize("spec", [StructuredOutput("json", '{"type": "object", "properties": {"a": {"type": 5}}}'),
                                  StructuredOutput("regex", "a[^\\s\\S]"), StructuredOutput("grammar", "root ::= (")])
def test_bad_constraint_queues_nothing(llm, spec):
    with pytest.raises(InvalidParameterError):
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(structured=spec))
    assert not llm.engine.has_unfinished() and llm.engine.kv_manager.num_used_blocks == 0


def test_speculating_requests_batched_with_a_constrained_one(llm):
    """n-gram speculation beside a JSON-constrained request: the speculating one's greedy tokens are
    those of plain decoding, the constrained one (which never speculates) still parses and validates,
    and its rows in verification steps were masked."""
    from servescope.config import SpeculativeConfig

    motif = list(range(200, 212))
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = llm.generate([motif * 4], plain)[0].outputs[0].token_ids
    spec = LLM.from_engine(llm.engine.with_config(speculative=SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})))
    constrained = SamplingParams(temperature=1.0, seed=3, max_tokens=120,
                                 structured=StructuredOutput("json", json.dumps(SCHEMA)))
    outs = spec.generate([motif * 4, list(range(10, 30))], [plain, constrained])
    assert outs[0].outputs[0].token_ids == want
    o = outs[1].outputs[0]
    assert o.finish_reason == "stop", o.text
    jsonschema.validate(json.loads(o.text), SCHEMA)
    assert outs[0].metrics.num_draft_tokens > 0 and outs[1].metrics.num_draft_tokens == 0
    # the constrained row's mask is timed in verification steps as in plain ones
    verifying = [r for r in spec.engine.step_records if r.num_draft_tokens]
    assert verifying and all(r.grammar_mask_seconds > 0 for r in verifying)
