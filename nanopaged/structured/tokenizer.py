"""The model's Hugging Face tokenizer as llguidance sees it: vocabulary size and EOS ids."""

from __future__ import annotations

from collections.abc import Iterable

from nanopaged.structured._llguidance import llguidance


def structured_tokenizer(
    hf_tokenizer, vocab_size: int, eos_token_ids: Iterable[int]
) -> llguidance.LLTokenizer:
    """An llguidance tokenizer over the model's vocab_size ids (a model's vocabulary is often
    padded past the tokenizer's: the padded ids decode to nothing and are never allowed)
    whose end of grammar is any of eos_token_ids. Takes about a second: build it once."""
    if hf_tokenizer is None:
        raise ValueError("structured_outputs needs the model's tokenizer; this model has none")
    eos = sorted(set(eos_token_ids))
    if not eos:
        raise ValueError("structured_outputs needs the model's EOS token id; none is known")
    # A tokenizer with added tokens past the model's vocabulary: its ids set the size (the
    # sampler ignores bits past the logits' columns).
    n_vocab = max(vocab_size, len(hf_tokenizer))
    try:
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos)
    except ValueError as e:  # a slow (Python) tokenizer: llguidance reads the Rust one's JSON
        raise ValueError(f"structured_outputs needs a fast Hugging Face tokenizer: {e}") from e
