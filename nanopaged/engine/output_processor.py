"""Stop strings: which sequences' newest tokens completed one (text from engine/detokenizer.py).

Byte-level BPE tokenizers (GPT-2's, Llama 3's, Qwen's, SmolLM's) need no decoding to watch for
stop strings: their text is the UTF-8 decode of the tokens' bytes, so a stop string is in the
text exactly when its UTF-8 bytes are in those bytes (UTF-8 resynchronizes at every character
start, and an invalid byte is replaced without swallowing the character after it). StopMatcher
looks up each new token's bytes and searches a short tail of them; only a hit decodes the text.
"""

from __future__ import annotations

import random

from nanopaged.engine.detokenizer import (
    ByteTail,
    IncrementalDetokenizer,
    has_stock_decode,
    update_texts,
)
from nanopaged.engine.sequence import Sequence


def find_stop_strings(seqs: list[Sequence], tokenizer) -> list[tuple[Sequence, int, str, str]]:
    """The sequences whose newest tokens completed a stop string in their output text, each as
    (seq, index in the full output text, the string, the full output text).

    Only text that appears once min_tokens tokens are out is searched: a sequence starts being
    watched with the text of its first min_tokens tokens already taken in.
    """
    items, before = [], []
    for seq in seqs:
        detok = seq.detokenizer
        if detok is None:
            detok = seq.detokenizer = IncrementalDetokenizer(
                seq.sampling_params.skip_special_tokens
            )
            out = seq.token_ids[seq.num_prompt_tokens :][: seq.sampling_params.min_tokens]
            if out:
                detok.update(tokenizer, out)
        items.append((detok, seq.token_ids, seq.num_prompt_tokens))
        before.append(len(detok.text))
    update_texts(tokenizer, items)
    found = []
    for seq, start_len in zip(seqs, before):
        text = seq.detokenizer.text
        # Only a stop string that ends in the new text was not there a token ago.
        stops = seq.sampling_params.stop
        if any(text.find(s, max(0, start_len - len(s) + 1)) >= 0 for s in stops):
            # Found in the windows' text: place it in the full decode, which users get.
            found += _place_stop(seq, tokenizer)
    return found


def _place_stop(seq: Sequence, tokenizer) -> list[tuple[Sequence, int, str, str]]:
    """[(seq, index, stop string, full output text)] for the first stop string in the full
    decode of seq's output (what users get) that ends after the text of its first min_tokens
    tokens; [] if none is there."""
    params = seq.sampling_params
    skip = params.skip_special_tokens
    output = seq.output_token_ids
    full = tokenizer.decode(output, skip_special_tokens=skip)
    floor = 0
    if params.min_tokens:
        floor = len(tokenizer.decode(output[: params.min_tokens], skip_special_tokens=skip))
    found = ((full.find(s, max(0, floor - len(s) + 1)), s) for s in params.stop)
    hits = [(i, s) for i, s in found if i >= 0]
    return [(seq, *min(hits), full)] if hits else []


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet: the printable character standing for each byte (printable
    Latin-1 bytes stand for themselves, the rest for 256, 257, ... in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]  # fmt: skip
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def byte_tables(tokenizer) -> dict[bool, list[bytes]] | None:
    """Each token id's bytes in the decoded text, per skip_special_tokens setting, for a
    tokenizer whose decode is the UTF-8 text of its tokens' bytes (a stock fast tokenizer with a
    byte-level decoder and no space clean-up); None for any other. A token whose characters
    are not all of the byte alphabet (an added token such as "<|im_end|>") stands for its
    UTF-8 text, as the byte-level decoder takes it. Checked against the tokenizer's own decode
    on every added token and a spread of the vocabulary: any difference gives None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        backend is None
        or getattr(tokenizer, "clean_up_tokenization_spaces", True)
        or not has_stock_decode(type(tokenizer))
    ):
        return None
    try:
        from tokenizers import decoders
    except ImportError:
        return None
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    alphabet = _byte_level_chars()
    table = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(i)
        if token is None:
            table.append(b"")  # decode drops ids it has no token for
            continue
        try:
            table.append(bytes(alphabet[c] for c in token))
        except KeyError:
            table.append(token.encode())
    added = backend.get_added_tokens_decoder()
    skipped = list(table)
    for i, tok in added.items():
        if tok.special and i < len(skipped):
            skipped[i] = b""
    tables = {False: table, True: skipped}
    rng = random.Random(0)
    ids = sorted({*added, *range(0, len(table), max(1, len(table) // 4000))})
    lists = [[i] for i in ids if i < len(table)]
    lists += [rng.sample(range(len(table)), min(8, len(table))) for _ in range(64)]
    for skip, t in tables.items():
        for ids in lists:
            want = b"".join(t[i] for i in ids)
            try:
                text = want.decode()
            except UnicodeDecodeError:
                continue  # replacement rules for broken bytes are not what is checked here
            if backend.decode(ids, skip) != text:
                return None
    return tables


def _ends_clean(buf: bytes) -> bool:
    """Whether buf's text ends in a whole character other than U+FFFD: what makes
    IncrementalDetokenizer take a window's text in (the bytes of a character that a later
    token completes, or broken ones, end the text in U+FFFD)."""
    if not buf or buf[-1] < 0x80:
        return True
    j = len(buf) - 1  # back to the last character's first byte (at most 3 continuations)
    while j > 0 and len(buf) - j < 4 and 0x80 <= buf[j] < 0xC0:
        j -= 1
    try:
        return not buf[j:].decode().endswith("\ufffd")
    except UnicodeDecodeError:
        return False


class StopMatcher:
    """Finds the sequences whose newest tokens completed a stop string (find_stop_strings'
    answer), by their bytes where the tokenizer allows (see the module docstring)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._tables: dict[bool, list[bytes]] | None = None
        self._built = False

    def tables(self) -> dict[bool, list[bytes]] | None:
        if not self._built:
            self._tables = byte_tables(self.tokenizer)
            self._built = True
        return self._tables

    def find(self, seqs: list[Sequence]) -> list[tuple[Sequence, int, str, str]]:
        tables = self.tables()
        if tables is None:
            return find_stop_strings(seqs, self.tokenizer)
        hits, by_text = [], []
        for seq in seqs:
            params = seq.sampling_params
            watch = seq.detokenizer
            if watch is None:
                if any("\ufffd" in s for s in params.stop):
                    by_text.append(seq)  # a replacement character has no bytes of its own
                    continue
            elif not isinstance(watch, ByteTail):
                by_text.append(seq)
                continue
            table = tables[params.skip_special_tokens]
            size = len(table)
            if watch is None:
                out = seq.token_ids[seq.num_prompt_tokens :][: params.min_tokens]
                prior = b"".join([table[t] if t < size else b"" for t in out])
                watch = seq.detokenizer = ByteTail(params.stop, prior, len(out))
            new = seq.token_ids[seq.num_prompt_tokens + watch.read :]
            if len(new) == 1:  # the usual step: one token, no join
                piece = table[new[0]] if new[0] < size else b""
            else:
                piece = b"".join([table[t] if t < size else b"" for t in new])
            buf = watch.tail + piece
            watch.read += len(new)
            if not _ends_clean(buf):
                # The text waits for the character to complete (see IncrementalDetokenizer);
                # so does the search, over all the bytes since the last one it made.
                watch.tail = buf
                continue
            start = watch.searched
            watch.tail = buf[-watch.keep :] if watch.keep else b""
            watch.searched = len(watch.tail)
            if any(buf.find(stop, max(0, start - len(stop) + 1)) >= 0 for stop in watch.stops):
                hits.append(seq)
        found = find_stop_strings(by_text, self.tokenizer) if by_text else []
        for seq in hits:
            found += _place_stop(seq, self.tokenizer)
        return found
