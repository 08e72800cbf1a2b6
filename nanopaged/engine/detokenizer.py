"""The text of a sequence's tokens as they arrive: incremental detokenization, decoding only a
short window of the newest tokens each step (a full decode every step is quadratic in the
output's length), the windows of all sequences in one batched call; and the byte tail a stop
string watch keeps instead where the tokenizer allows (engine/output_processor.py)."""

from __future__ import annotations

import functools


@functools.cache
def has_stock_decode(tokenizer_type: type) -> bool:
    """Whether tokenizer_type decodes as transformers' fast tokenizer does: its Rust tokenizer's
    decode, then an optional clean-up of spaces (an override could change the text)."""
    try:
        import transformers
    except ImportError:
        return False
    stock = getattr(transformers, "TokenizersBackend", None) or getattr(
        transformers, "PreTrainedTokenizerFast", None
    )
    base = getattr(transformers, "PreTrainedTokenizerBase", None)
    return (
        stock is not None
        and base is not None
        and issubclass(tokenizer_type, stock)
        and tokenizer_type._decode is stock._decode
        and tokenizer_type.decode is base.decode
        and tokenizer_type.batch_decode is base.batch_decode
    )


def decode_batch(tokenizer, token_lists: list[list[int]], skip_special_tokens: bool) -> list[str]:
    """`tokenizer.decode(ids, skip_special_tokens=...)` of each list.

    A stock fast tokenizer that cleans up no spaces decodes with its Rust tokenizer alone, the
    same text without transformers' per-call work (several times the decode itself for the few
    tokens of a window, and a step decodes two windows per watched sequence).
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        backend is None
        or getattr(tokenizer, "clean_up_tokenization_spaces", True)
        or not has_stock_decode(type(tokenizer))
    ):
        return tokenizer.batch_decode(token_lists, skip_special_tokens=skip_special_tokens)
    decode = backend.decode
    return [decode(ids, skip_special_tokens) for ids in token_lists]


class IncrementalDetokenizer:
    """The text of a growing list of token ids, extended from a window of the newest ones.

    A window starts a few tokens back (prefix_offset), so tokenizers that need context (a
    leading space, a multi-byte character split over tokens) decode the new tokens the same
    way they would in the full text; text that ends in an incomplete character waits.
    """

    def __init__(self, skip_special_tokens: bool) -> None:
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.prefix_offset = 0  # start of the decoding window
        self.read_offset = 0  # tokens whose text is already in self.text
        # The text of the window's already-read tokens while the window has not moved (a step
        # whose text ended in an incomplete character): it needs no second decode.
        self.prefix_text: str | None = None

    def advance(self, num_tokens: int, prefix: str, full: str) -> None:
        """Take the decoded window texts of a list of num_tokens token ids."""
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = num_tokens
            self.prefix_text = None
        else:
            self.prefix_text = prefix

    def update(self, tokenizer, token_ids: list[int]) -> str:
        """Extend the text with token_ids[read_offset:]; returns the whole text so far."""
        update_texts(tokenizer, [(self, token_ids, 0)])
        return self.text


def update_texts(
    tokenizer, items: list[tuple[IncrementalDetokenizer, list[int], int]]
) -> None:
    """Bring every detokenizer's text up to its (token list, start), in one batched decode per
    skip_special_tokens setting."""
    for skip in (True, False):
        todo, windows = [], []
        for detok, ids, start in items:
            if detok.skip_special_tokens != skip:
                continue
            num_tokens = len(ids) - start
            if num_tokens <= detok.read_offset:
                continue  # nothing new
            # Slice only the window: no copy of the whole output each step.
            window = ids[start + detok.prefix_offset :]
            windows.append(window)
            if detok.prefix_text is None:
                windows.append(window[: detok.read_offset - detok.prefix_offset])
            todo.append((detok, num_tokens))
        if not todo:
            continue
        texts = iter(decode_batch(tokenizer, windows, skip))
        for detok, num_tokens in todo:
            full = next(texts)
            prefix = detok.prefix_text
            detok.advance(num_tokens, next(texts) if prefix is None else prefix, full)


class ByteTail:
    """A watched sequence's newest output bytes: enough to hold a stop string that the next
    tokens complete."""

    def __init__(self, stops: list[str], prior: bytes = b"", num_prior: int = 0) -> None:
        """prior: the bytes of the first num_prior output tokens, taken in unsearched (the
        min_tokens window, where no stop string may end)."""
        self.stops = [s.encode() for s in stops]
        self.keep = max(map(len, self.stops)) - 1
        # From keep bytes before the last search (more while a character waits); its first
        # `searched` bytes were there at the last search: a new match must end after them.
        self.tail = prior[-self.keep :] if self.keep else b""
        self.searched = len(self.tail)
        self.read = num_prior  # output tokens already taken in
