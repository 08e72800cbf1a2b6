"""RequestOutputs from a request's sequences: the final one, and partial ones while it runs
(everything so far, or what is new, as its SamplingParams.output_kind asks)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanopaged.engine.detokenizer import decode_batch
from nanopaged.engine.sequence import Sequence, SequenceGroup
from nanopaged.inputs import PromptType
from nanopaged.outputs import CompletionOutput, LazyLogprobs, RequestOutput, TokenDecoder
from nanopaged.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class RunningRequest:
    """A request the engine holds: its group of sequences, the prompt and the SamplingParams
    as the caller gave them (the group's may add logprobs=0, which best_of ranks by), and what
    its delta outputs already reported."""

    request_id: str
    prompt: PromptType
    params: SamplingParams
    group: SequenceGroup
    # sample index -> (tokens, characters) already reported (output_kind DELTA)
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)
    sent_prompt_logprobs: bool = False


def reports_progress(p: SamplingParams) -> bool:
    """Whether a running request reports partial outputs: not FINAL_ONLY, and not best_of
    (which picks its samples only at the end)."""
    return p.output_kind != RequestOutputKind.FINAL_ONLY and (p.best_of or p.n) == p.n


class OutputBuilder:
    """Builds RequestOutputs; decodes each token id once for the Logprobs it names."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._decoded_tokens: dict[int, str] = {}

    def token_decoder(self) -> TokenDecoder | None:
        """token ids -> their texts, for Logprob.decoded_token (None without a tokenizer).

        Memoized for the engine's life: an output with logprobs names k + 1 tokens per
        generated token, mostly the same few thousand; those not seen before are decoded in one
        batch. The outputs keep this decoder until they are read: it holds the tokenizer and the
        texts, never the engine (and so its model and KV cache).
        """
        tokenizer, cache = self.tokenizer, self._decoded_tokens
        if tokenizer is None:
            return None

        def decode(token_ids: list[int]) -> list[str]:
            missing = [tok for tok in set(token_ids) if tok not in cache]
            if missing:
                cache.update(zip(missing, decode_batch(tokenizer, [[t] for t in missing], False)))
            return [cache[tok] for tok in token_ids]

        return decode

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def build(self, req: RunningRequest, streaming: bool = False) -> RequestOutput:
        """req's RequestOutput: its n samples (with best_of, the n of highest cumulative
        logprob, best first). streaming: req reports as it runs, under its output_kind (a
        running sample's text stops where it is final; DELTA: only what is new since the
        last report, the final one included)."""
        p, group = req.params, req.group
        seqs = sorted(group.seqs, key=lambda s: s.index)
        first = seqs[0]
        if len(seqs) > p.n:
            seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[: p.n]
        delta = streaming and p.output_kind == RequestOutputKind.DELTA
        decoder = self.token_decoder()
        outputs = [self._completion(s, j, p, req, decoder, streaming, delta)
                   for j, s in enumerate(seqs)]  # fmt: skip
        out = RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt if isinstance(req.prompt, str) else None,
            prompt_token_ids=first.token_ids[: first.num_prompt_tokens],
            outputs=outputs,
            finished=group.is_finished,
            num_cached_tokens=first.num_cached_tokens,
        )
        rows = first.prompt_logprobs  # scored by the prefill steps
        if p.prompt_logprobs is not None and len(rows) == first.num_prompt_tokens - 1:
            if not (delta and req.sent_prompt_logprobs):
                out.prompt_logprobs = [None, *LazyLogprobs.from_rows(rows, decoder)]
                req.sent_prompt_logprobs = True
        return out

    def _completion(
        self,
        seq: Sequence,
        index: int,
        p: SamplingParams,
        req: RunningRequest,
        decoder: TokenDecoder | None,
        streaming: bool,
        delta: bool,
    ) -> CompletionOutput:
        text = getattr(seq, "text", None)  # set where a stop string ended the sequence
        if text is None:
            text = self.decode(seq.output_token_ids, p.skip_special_tokens)
            if streaming and not seq.is_finished:
                # A running sequence's text ends where it is final: not in a character still
                # incomplete, nor in what could be the start of a stop string.
                text = text.rstrip("\ufffd")
                if p.stop:
                    text = text[: max(0, len(text) - max(map(len, p.stop)) + 1)]
        token_ids, rows = seq.output_token_ids, seq.logprobs
        if delta:
            num_tokens, num_chars = req.sent.get(seq.index, (0, 0))
            req.sent[seq.index] = (len(token_ids), max(num_chars, len(text)))
            token_ids, text = token_ids[num_tokens:], text[num_chars:]
            rows = rows[num_tokens:]
        with_logprobs = p.logprobs is not None
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=seq.cumulative_logprob if with_logprobs else None,
            logprobs=LazyLogprobs.from_rows(rows, decoder) if with_logprobs else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
