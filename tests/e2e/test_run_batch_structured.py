"""`nanopaged run-batch` with response_format / structured_outputs: bad ones are 400 records."""

from __future__ import annotations

import importlib.util
import json

import pytest
from test_run_batch import CONV, _line, _read, llm, model_dir  # noqa: F401 (fixtures)

from nanopaged import SamplingParams
from nanopaged.entrypoints.run_batch import (
    CHAT_URL,
    COMPLETIONS_URL,
    BadRequest,
    run_batch,
    sampling_params_from_body,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llguidance") is None, reason="pip install 'nanopaged[structured]'"
)

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer", "minimum": 0}},
    "required": ["city"],
}


def _chat(fmt: dict | None = None, **extra) -> dict:
    body = {"messages": CONV, "temperature": 0, "max_completion_tokens": 4, **extra}
    if fmt is not None:
        body["response_format"] = fmt
    return body


def test_response_formats_become_structured_outputs():
    defaults = SamplingParams()
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
    for url in (CHAT_URL, COMPLETIONS_URL):
        body = _chat(fmt) if url == CHAT_URL else {"prompt": "x", "response_format": fmt}
        spec = sampling_params_from_body(body, url, defaults).structured_outputs
        assert spec.kind == "json" and spec.json == SCHEMA
    spec = sampling_params_from_body(_chat({"type": "json_object"}), CHAT_URL, defaults)
    assert spec.structured_outputs.json_object is True
    plain = sampling_params_from_body(_chat({"type": "text"}), CHAT_URL, defaults)
    assert plain.structured_outputs is None
    assert sampling_params_from_body(_chat(), CHAT_URL, defaults).structured_outputs is None
    regex = sampling_params_from_body(
        _chat(structured_outputs={"regex": "[a-z]+"}), CHAT_URL, defaults
    ).structured_outputs
    assert regex.kind == "regex" and regex.regex == "[a-z]+"


BAD = {
    "not-an-object": ("[1]", "body.response_format must be an object"),
    "unknown-type": ({"type": "xml"}, "body.response_format.type must be"),
    "no-schema": ({"type": "json_schema", "json_schema": {"name": "x"}}, "with the schema"),
    "bad-schema": (
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}},
        "structured_outputs.json is not a valid JSON schema",
    ),
    "bad-pattern": (
        {"type": "json_schema",
         "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(a"}}},
        "structured_outputs.json is not a valid JSON schema",
    ),
}  # fmt: skip
BAD_EXTRA = {
    "bad-regex": ({"regex": "a("}, "structured_outputs.regex is not a valid regular expression"),
    "bad-grammar": ({"grammar": "start: nothing"}, "structured_outputs.grammar is not a valid"),
    "two-fields": ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    "unknown-field": ({"xml": "<a/>"}, "body.structured_outputs takes json, regex"),
    "empty-choice": ({"choice": []}, "structured_outputs.choice must be a non-empty"),
}


def test_bad_response_formats_are_400_records(llm, tmp_path):  # noqa: F811
    lines = [_line("ok-text", CHAT_URL, _chat({"type": "text"}))]
    for cid, (fmt, _) in BAD.items():
        fmt = json.loads(fmt) if isinstance(fmt, str) else fmt
        url = COMPLETIONS_URL if cid == "bad-pattern" else CHAT_URL
        body = {"prompt": "x", "response_format": fmt} if url == COMPLETIONS_URL else _chat(fmt)
        lines.append(_line(cid, url, body))
    for cid, (extra, _) in BAD_EXTRA.items():
        lines.append(_line(cid, CHAT_URL, _chat(structured_outputs=extra)))
    both = _chat({"type": "json_object"}, structured_outputs={"regex": "a"})
    lines.append(_line("both", CHAT_URL, both))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    counts = run_batch(llm, inp, out, "m", use_tqdm=False)
    expected = {**BAD, **BAD_EXTRA, "both": (None, "both a JSON response_format")}
    assert counts == {"ok": 1, "error": len(expected), "skipped": 0}
    by_id = {r["custom_id"]: r for r in _read(out)}
    assert by_id["ok-text"]["response"]["status_code"] == 200
    for cid, (_, message) in expected.items():
        record = by_id[cid]
        assert record["response"]["status_code"] == 400, cid
        assert record["response"]["body"] is None
        assert message in record["error"]["message"], (cid, record["error"]["message"])


def test_bad_spec_raises_bad_request_before_the_engine():
    with pytest.raises(BadRequest, match="structured_outputs.regex is not a valid"):
        sampling_params_from_body(
            {"prompt": "x", "structured_outputs": {"regex": "[z-a]"}}, COMPLETIONS_URL,
            SamplingParams(),
        )  # fmt: skip
