"""Per-request logit controls (vLLM's logit_bias, bad_words, allowed_token_ids) on logits rows.

A small torch function on the rows of the requests that ask for them, applied on the
SampleOutput path like the penalties; the fast sampler never sees these requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nanopaged.engine.sequence import Sequence


def bad_words_token_ids(bad_words: list[str], tokenizer) -> list[list[int]]:
    """Each bad word as token ids, with and without a leading space (as vLLM does): a word
    inside a sentence usually tokenizes with its preceding space."""
    out: list[list[int]] = []
    for word in bad_words:
        for text in (word, " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def _banned_by_bad_words(seq: Sequence) -> list[int]:
    """Last tokens of the bad words whose other tokens end the output so far."""
    words: list[list[int]] = getattr(seq, "bad_words_token_ids", None) or []
    out = seq.output_token_ids
    banned = []
    for ids in words:
        prefix = ids[:-1]
        if not prefix or (len(out) >= len(prefix) and out[len(out) - len(prefix) :] == prefix):
            banned.append(ids[-1])
    return banned


def apply_logit_controls(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [len(seqs), vocab]; returns them with each sequence's controls applied.

    allowed_token_ids masks every other token, bad_words mask the completing token, then
    logit_bias is added (so a bias never revives a masked token).
    """
    rows = [i for i, s in enumerate(seqs) if s.sampling_params.has_logit_controls]
    if not rows:
        return logits
    logits = logits.clone()
    vocab, dev = logits.shape[-1], logits.device
    for i in rows:
        p = seqs[i].sampling_params
        row = logits[i]
        if p.allowed_token_ids is not None:
            keep = torch.zeros(vocab, dtype=torch.bool, device=dev)
            keep[torch.tensor(p.allowed_token_ids, device=dev)] = True
            row.masked_fill_(~keep, float("-inf"))
        if p.bad_words:
            banned = _banned_by_bad_words(seqs[i])
            if banned:
                row[torch.tensor(banned, device=dev)] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=dev)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=dev)
            row.index_add_(0, ids, bias)
    return logits
