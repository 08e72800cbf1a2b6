"""Turning sampled tokens into text as they arrive: incremental detokenization and stop strings.

Each step decodes only a short window of a sequence's newest tokens, so the work per token does
not grow with the output's length (a full decode every step is quadratic in it), and the
windows of all sequences go to the tokenizer in one batched call.
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

    def windows(
        self, token_ids: list[int], start: int = 0
    ) -> tuple[list[int], list[int]] | None:
        """(tokens already read, all tokens) of the window to decode, for the text of
        token_ids[start:] (slicing only the window: no copy of the whole output each step);
        None: nothing new."""
        if len(token_ids) - start <= self.read_offset:
            return None
        window = token_ids[start + self.prefix_offset :]
        return window[: self.read_offset - self.prefix_offset], window

    def advance(self, num_tokens: int, prefix: str, full: str) -> None:
        """Take the decoded window texts of a list of num_tokens token ids."""
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = num_tokens

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
        todo = []
        for detok, ids, start in items:
            if detok.skip_special_tokens == skip:
                w = detok.windows(ids, start)
                if w is not None:
                    todo.append((detok, len(ids) - start, w))
        if not todo:
            continue
        texts = tokenizer.batch_decode(
            [w[0] for _, _, w in todo] + [w[1] for _, _, w in todo], skip_special_tokens=skip
        )
        for i, (detok, n, _) in enumerate(todo):
            detok.advance(n, texts[i], texts[len(todo) + i])


def find_stop_strings(seqs: list[Sequence], tokenizer) -> list[tuple[Sequence, int, str, str]]:
    """The sequences whose newest tokens completed a stop string in their output text, each as
    (seq, index in the full output text, the string, the full output text)."""
    items, before = [], []
    for seq in seqs:
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(seq.sampling_params.skip_special_tokens)
        items.append((seq.detokenizer, seq.token_ids, seq.num_prompt_tokens))
        before.append(len(seq.detokenizer.text))
    update_texts(tokenizer, items)
    found = []
    for seq, start_len in zip(seqs, before):
        stops = seq.sampling_params.stop
        text = seq.detokenizer.text
        # Only the tail can hold a stop string that was not there a token ago.
        start = max(0, start_len - max(len(s) for s in stops) + 1)
        if not any(text.find(s, start) >= 0 for s in stops):
            continue
        # Found in the windows' text: place it in the full decode, which is what users get.
        skip = seq.sampling_params.skip_special_tokens
        full = tokenizer.decode(seq.output_token_ids, skip_special_tokens=skip)
        hits = [(i, s) for i, s in ((full.find(s), s) for s in stops) if i >= 0]
        if hits:
            found.append((seq, *min(hits), full))
    return found
