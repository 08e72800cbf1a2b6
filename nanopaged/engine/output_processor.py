"""Turning sampled tokens into text as they arrive: incremental detokenization and stop strings.

Each step decodes only a short window of a sequence's newest tokens, so the work per token does
not grow with the output's length (a full decode every step is quadratic in it).
"""

from __future__ import annotations

from nanopaged.engine.sequence import Sequence


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

    def update(self, tokenizer, token_ids: list[int]) -> str:
        """Extend the text with token_ids[read_offset:]; returns the whole text so far."""
        if len(token_ids) <= self.read_offset:
            return self.text
        skip = self.skip_special_tokens
        window = token_ids[self.prefix_offset :]
        seen = window[: self.read_offset - self.prefix_offset]
        prefix = tokenizer.decode(seen, skip_special_tokens=skip)
        full = tokenizer.decode(window, skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(token_ids)
        return self.text


def find_stop_string(seq: Sequence, tokenizer) -> tuple[int, str, str] | None:
    """The first stop string of seq's output text that the newest tokens completed, as (index
    in the full output text, the string, the full output text); None when there is none."""
    p = seq.sampling_params
    detok = seq.detokenizer
    if detok is None:
        detok = seq.detokenizer = IncrementalDetokenizer(p.skip_special_tokens)
    before = len(detok.text)
    text = detok.update(tokenizer, seq.output_token_ids)
    # Only the tail can hold a stop string that was not there a token ago.
    start = max(0, before - max(len(s) for s in p.stop) + 1)
    hits = [(i, s) for i, s in ((text.find(s, start), s) for s in p.stop) if i >= 0]
    if not hits:
        return None
    # Found in the window's text: place it in the full decode, which is what users get.
    full = tokenizer.decode(seq.output_token_ids, skip_special_tokens=p.skip_special_tokens)
    hits = [(i, s) for i, s in ((full.find(s), s) for s in p.stop) if i >= 0]
    return (*min(hits), full) if hits else None
