"""Structured outputs in the engine: every output obeys its JSON schema / regex / choice / grammar.

On the built-in tiny model (random-ish text, real tokenizer). The schemas are bounded (short strings,
bounded integers, no extra properties), so a constrained output must end with ``finish_reason="stop"``
well within ``max_tokens``, and then it must parse and validate. Greedy constrained decoding is
checked token for token against transformers' own generate() with the same mask as a logits
processor (no flashpage in the reference).
"""

from __future__ import annotations

import json
import re
import warnings

import jsonschema
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from flashpage import LLM, SamplingParams
from flashpage.engine.structured import GrammarEngine, StructuredOutputsParams, unpack_bitmask
from flashpage.patches import is_patched, unpatch
from flashpage.testing import compare_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"], "additionalProperties": False}
ITEMS = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
    "ok": {"type": "boolean"}, "score": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5},
                                                   {"type": "null"}]}},
    "required": ["items", "ok", "score"], "additionalProperties": False}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
PROMPTS = ["The list of items is", "Return a new object when", "import os\n", "Raise an exception if"]
BOUND = 64  # max_tokens: far more than any output of these bounded constraints needs


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(*tiny, max_num_seqs=64)


def _json(schema: dict, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": BOUND, **kw}, structured_outputs=StructuredOutputsParams(json=schema))


def _valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_json_schema_outputs_parse_and_validate(llm):
    params = [_json(PERSON, temperature=1.0, seed=i) for i in range(12)] + \
             [_json(ITEMS, temperature=1.0, seed=i) for i in range(12)] + [_json(PERSON, temperature=0)]
    outs = llm.generate([PROMPTS[i % 4] for i in range(len(params))], params, use_tqdm=False)
    for p, out in zip(params, outs, strict=True):
        (c,) = out.outputs
        assert c.finish_reason == "stop", c  # bounded schema: the grammar completes well before BOUND tokens
        _valid(c.text, p.structured_outputs.json)
        assert llm.sampler.eos_token_ids.isdisjoint(c.token_ids[:-1])  # EOS only where the grammar accepts
    assert len({o.outputs[0].text for o in outs}) > 10  # sampling still samples


def test_regex_choice_grammar_and_json_object_obeyed(llm):
    gbnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    lark = 'start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/'
    cases = [("regex", DATE, lambda t: re.fullmatch(DATE, t)),
             ("choice", ["yes", "no", "not sure"], lambda t: t in ("yes", "no", "not sure")),
             ("grammar", lark, lambda t: re.fullmatch(r"x=[0-9]{1,3};", t)),
             ("grammar", gbnf, lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
             ("json_object", True, lambda t: isinstance(json.loads(t), dict))]
    params, checks = [], []
    for kind, value, check in cases:
        for temp in (0.0, 1.0):
            params.append(SamplingParams(max_tokens=BOUND, temperature=temp, seed=3, n=2 if temp else 1,
                                         structured_outputs=StructuredOutputsParams(**{kind: value})))
            checks.append((kind, check))
    outs = llm.generate(["The value is"] * len(params), params, use_tqdm=False)
    for (kind, check), out in zip(checks, outs, strict=True):
        for c in out.outputs:
            if kind == "json_object" and c.finish_reason == "length":  # free-form strings may run to the limit
                continue
            assert c.finish_reason == "stop" and check(c.text), (kind, c)


def test_n_samples_each_have_their_own_matcher(llm):
    p = _json(PERSON, temperature=1.0, seed=7, n=6)
    (out,) = llm.generate(PROMPTS[0], p, use_tqdm=False)
    assert len(out.outputs) == 6
    for c in out.outputs:
        assert c.finish_reason == "stop"
        _valid(c.text, PERSON)
    assert len({c.text for c in out.outputs}) > 1
    again = llm.generate(PROMPTS[0], p, use_tqdm=False)[0]  # seeded: every sample reproduces
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_seeded_sample_is_the_same_alone_or_batched(llm):
    p = _json(ITEMS, temperature=1.0, seed=11)
    alone = llm.generate(PROMPTS[1], p, use_tqdm=False)[0].outputs[0]
    others = [SamplingParams(max_tokens=20, temperature=1.0), _json(PERSON, temperature=0.7)]
    batched = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [others[0], p, others[1]], use_tqdm=False)
    assert batched[1].outputs[0].token_ids == alone.token_ids


def test_unconstrained_rows_are_untouched(llm):
    plain = SamplingParams(max_tokens=24, temperature=0)
    ref = llm.generate(PROMPTS, plain, use_tqdm=False)
    mixed = llm.generate(PROMPTS * 2, [plain] * 4 + [_json(PERSON, temperature=0)] * 4, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in ref]


class _GrammarMask(LogitsProcessor):
    """transformers' side of the oracle: llguidance's mask for one unpadded greedy sequence."""

    def __init__(self, engine: GrammarEngine, spec: StructuredOutputsParams, prompt_len: int) -> None:
        self.g = engine.new_matcher(spec)
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_len:
            assert self.g.matcher.consume_token(int(input_ids[0, -1]))
        mask = unpack_bitmask(torch.frombuffer(bytearray(self.g.matcher.compute_bitmask()), dtype=torch.int32)[None],
                              scores.shape[1])
        return scores.masked_fill(~mask, float("-inf"))


def test_greedy_constrained_equals_transformers_generate_with_the_same_mask(llm, tiny):
    model, tok = tiny
    specs = [StructuredOutputsParams(json=PERSON), StructuredOutputsParams(json=ITEMS),
             StructuredOutputsParams(regex=DATE), StructuredOutputsParams(choice=["alpha", "beta", "gamma"])]
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=BOUND, temperature=0, structured_outputs=s)
                                  for s in specs], use_tqdm=False)
    engine = GrammarEngine(tok, llm.vocab_size, [0])
    was = is_patched(model)
    unpatch(model)
    try:
        for prompt, spec, out in zip(prompts, specs, outs, strict=True):
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=BOUND, do_sample=False, pad_token_id=0,
                                 logits_processor=LogitsProcessorList([_GrammarMask(engine, spec, len(prompt))]),
                                 return_dict_in_generate=True, output_scores=True)
            ref_ids = ref.sequences[0, len(prompt):].tolist()
            if ref_ids and ref_ids[-1] == 0:
                ref_ids = ref_ids[:-1]  # transformers needs EOS to stop; the engine stops when the grammar is done
            got = out.outputs[0].token_ids
            match = compare_greedy(ref_ids, got, [s[0] for s in ref.scores])
            assert match.ok, f"{spec.kind}: {match.explain()}\nref={ref_ids}\ngot={got}"
    finally:
        if was:
            llm._ensure_patched()


def test_preemption_with_a_tiny_pool_gives_the_same_outputs(tiny, llm):
    specs = [_json(PERSON, temperature=0), _json(ITEMS, temperature=0),
             _json(PERSON, temperature=1.0, seed=5, n=2)]
    prompts = [PROMPTS[i % 4] * 3 for i in range(9)]
    params = [specs[i % 3] for i in range(9)]
    ref = llm.generate(prompts, params, use_tqdm=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the pool is deliberately smaller than max_model_len
        small = LLM(*tiny, num_blocks=14, block_size=4, max_num_seqs=16, enable_prefix_caching=False)
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.stats().preemptions > 0
    for r, g, p in zip(ref, got, params, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in r.outputs]
        for c in g.outputs:
            assert c.finish_reason == "stop"
            _valid(c.text, p.structured_outputs.json)


def test_matcher_rebuilt_when_it_lags_the_output(llm):
    """Were a matcher ever out of step with its sample's output, it is replayed (or rolled back) first."""
    p = _json(PERSON, temperature=0)
    ref = llm.generate(PROMPTS[2], p, use_tqdm=False)[0].outputs[0].token_ids
    rid = llm.add_request(PROMPTS[2], p)
    for _ in range(6):
        llm.step()
    seq = llm._groups[rid].seqs[0]
    seq.grammar.matcher.rollback(3)  # simulate a matcher left behind
    seq.grammar.consumed -= 3
    outs = []
    while llm.has_unfinished_requests():
        outs += [o for o in llm.step() if o.request_id == rid and o.finished]
    assert outs[-1].outputs[0].token_ids == ref


def test_prefix_cache_stop_strings_stream_and_ignore_eos(llm):
    p = _json(PERSON, temperature=0)
    LONG = PROMPTS[3] * 12  # noqa: N806  (several full KV blocks)
    first = llm.generate(LONG, p, use_tqdm=False)[0]
    second = llm.generate(LONG, p, use_tqdm=False)[0]
    assert second.metrics.cached_prompt_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    streamed = "".join(d.text for d in llm.stream(LONG, p))
    assert streamed == first.outputs[0].text
    cut = llm.generate(LONG, _json(PERSON, temperature=0, stop=['"age"']), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and first.outputs[0].text.startswith(cut.text) and '"age"' not in cut.text
    no_eos = llm.generate(LONG, _json(PERSON, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert no_eos.outputs[0].finish_reason == "stop"  # a complete grammar ends the sample even so
    assert no_eos.outputs[0].text == first.outputs[0].text


def test_length_leaves_a_valid_prefix(llm, tiny):
    _, tok = tiny
    p = _json(PERSON, temperature=1.0, seed=2, max_tokens=5, n=4)
    (out,) = llm.generate(PROMPTS[0], p, use_tqdm=False)
    engine = GrammarEngine(tok, llm.vocab_size, [0])
    for c in out.outputs:
        assert c.finish_reason == "length" and len(c.token_ids) == 5
        g = engine.new_matcher(p.structured_outputs)
        assert g.matcher.consume_tokens(c.token_ids) and not g.matcher.is_error()  # a prefix of a valid document


@pytest.mark.parametrize(("fields", "match"), [
    ({"json": {"type": "strng"}}, r"structured_outputs\.json"),
    ({"json": "{not json"}, r"structured_outputs\.json is not valid JSON"),
    ({"regex": "[a-"}, r"structured_outputs\.regex"),
    ({"grammar": "start: undefined_rule"}, r"structured_outputs\.grammar"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one of"),
    ({"choice": []}, r"structured_outputs\.choice"),
    ({"choice": "yes"}, r"structured_outputs\.choice"),
])
def test_bad_constraints_are_refused_before_queueing(llm, fields, match):
    with pytest.raises(ValueError, match=match):
        llm.add_request(PROMPTS[0], SamplingParams(structured_outputs=fields))
    assert not llm.has_unfinished_requests()


def test_unknown_field_named():
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_bench_structured_quick_reports_the_cost_per_token():
    from flashpage.bench.structured import format_report, run

    result = run(quick=True)
    plain, constrained, mixed = result["rows"]
    assert result["outputs_agree"] and result["invalid_outputs"] == 0
    assert plain["constrained_tokens"] == 0 and plain["grammar_ms_per_constrained_token"] is None
    assert constrained["constrained_tokens"] == constrained["output_tokens"] > 0
    assert 0 < mixed["constrained_tokens"] < mixed["output_tokens"]
    assert constrained["grammar_ms_per_constrained_token"] > 0 and constrained["constrained_stopped"] > 0
    assert "grammar ms/constr. token" in format_report(result)


def test_a_broken_matcher_ends_only_its_sample(llm, tiny):
    """A matcher in an error state (a bug) must not crash the step: its sample ends 'abort', others go on."""
    p = _json(PERSON, temperature=1.0, seed=1)
    plain = SamplingParams(max_tokens=12, temperature=1.0, seed=2)
    ref = llm.generate(PROMPTS[1], plain, use_tqdm=False)[0].outputs[0].token_ids
    bad = llm.add_request(PROMPTS[0], p)
    good = llm.add_request(PROMPTS[1], plain)
    llm.step()
    g = llm._groups[bad].seqs[0].grammar
    assert not g.matcher.consume_token(tiny[1]("}}}")["input_ids"][0]) and g.matcher.is_error()
    final = {}
    while llm.has_unfinished_requests():
        final.update({o.request_id: o for o in llm.step() if o.finished})
    assert final[bad].outputs[0].finish_reason == "abort"
    assert final[good].outputs[0].token_ids == ref


def test_a_constraint_is_compiled_once_and_copied_per_sample(llm, tiny):
    engine = GrammarEngine(tiny[1], llm.vocab_size, [0])
    spec = StructuredOutputsParams(json=PERSON)
    a, b = engine.new_matcher(spec), engine.new_matcher(StructuredOutputsParams(json=dict(PERSON)))
    assert engine.compile(spec) is engine.compile(StructuredOutputsParams(json=PERSON)) and len(engine._matchers) == 1
    assert a.matcher is not b.matcher
    assert a.matcher.consume_token(tiny[1]("{")["input_ids"][0])
    assert b.matcher.compute_bitmask() == engine.compile(spec).compute_bitmask()  # the pristine one never moves
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        llm.prepare_structured_outputs(StructuredOutputsParams(regex="(unclosed"))


def test_mask_allows_eos_only_where_the_grammar_accepts(tiny):
    from types import SimpleNamespace

    tok = tiny[1]
    engine = GrammarEngine(tok, 4096, [0])
    digit = {d: tok.convert_tokens_to_ids(d) for d in "0123456789"}
    letter = tok.convert_tokens_to_ids("a")
    g = engine.new_matcher(StructuredOutputsParams(regex="[0-9]{2,3}"))
    free = SimpleNamespace(grammar=None)
    for out, eos_ok, digits_ok in (([], False, True), (["1"], False, True), (["1", "2"], True, True),
                                   (["1", "2", "3"], True, False)):
        ids = [digit[d] for d in out]
        seq = SimpleNamespace(grammar=g, output_ids=ids, num_output=len(ids))
        logits = torch.zeros(2, 4096)
        masked = engine.apply(logits, [seq, free])
        assert torch.equal(masked[1], logits[1])  # the unconstrained row is untouched
        allowed = masked[0] > float("-inf")
        assert bool(allowed[0]) is eos_ok, out
        assert bool(allowed[digit["7"]]) is digits_ok and not bool(allowed[letter]), out
