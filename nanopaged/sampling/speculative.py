"""A step with drafts (speculative decoding): its rows verified by the rejection sampler, and
the handle that brings each row's new tokens (1 .. d + 1 of them) to the host."""

from __future__ import annotations

import numpy as np
import torch

from nanopaged.platform import HostCopy, to_device
from nanopaged.sampling.ops import SamplingTensors
from nanopaged.sampling.output import DeviceSamples, StepHandle, check_finite
from nanopaged.sampling.rejection import RejectionOutput, rejection_sample


class DraftStepHandle(StepHandle):
    """A verifying step's samples: per sampled row, the list of its new tokens (accepted
    drafts, then the correction or bonus token). Never plain: the next step waits for them,
    as its drafts are proposed from them."""

    _drafts: list[list[int]] | None = None  # of_draws: each row's drafts

    @classmethod
    def of_rejection(cls, out: RejectionOutput) -> DraftStepHandle:
        handle = cls()
        handle._copy = HostCopy([out.token_ids, out.num_accepted, out.sampled_logits])
        return handle

    @classmethod
    def of_draws(cls, draws: DeviceSamples, drafts: list[list[int]]) -> DraftStepHandle:
        """From the plain sampler's draw at every verified position (rows as verify_drafts
        takes them; sampled in the decode graph). With one-hot drafts these draws are the
        rejection sampler's targets: a row keeps its drafts while each equals the draw at its
        position, then the draw at the first that does not (or the bonus draw)."""
        handle = cls()
        handle._copy = HostCopy([draws.token_ids, draws.sampled_logits])
        handle._drafts = drafts
        return handle

    def result(self) -> list[list[int]]:
        if self.outputs is None and self._drafts is not None:
            self.outputs, self._finite = _accepted_draws(*self._copy.result(), self._drafts)
        elif self.outputs is None:
            tokens, num_accepted, picked = self._copy.result()
            # A row's logit is 0 past its new tokens: the check covers those it emits.
            self._finite = torch.isfinite(picked).all(dim=1)
            self.outputs = [row[: n + 1] for row, n in zip(tokens.tolist(), num_accepted.tolist())]
        if self._finite is not None:
            check_finite(self._finite, self.seqs)
            self._finite = None
        return self.outputs


def _accepted_draws(draws: torch.Tensor, logits: torch.Tensor, drafts: list[list[int]]
                    ) -> tuple[list[list[int]], torch.Tensor]:  # fmt: skip
    """(each row's new tokens, whether finite logits decided all of them) from the draws at
    its verified positions (DraftStepHandle.of_draws)."""
    tokens = draws.tolist()
    finite = torch.isfinite(logits).tolist()  # host lists: no tensor op per row
    outputs, rows_finite, at = [], [], 0
    for d in drafts:
        n = 0
        while n < len(d) and tokens[at + n] == d[n]:
            n += 1
        outputs.append(tokens[at : at + n + 1])
        rows_finite.append(all(finite[at : at + n + 1]))
        at += len(d) + 1
    return outputs, torch.tensor(rows_finite, dtype=torch.bool)


def verify_drafts(
    logits: torch.Tensor, st: SamplingTensors, drafts: list[list[int]]
) -> DraftStepHandle:
    """The new tokens of each sampled row from its logits rows ([sum(d_i + 1), vocab]: row i's
    last token, then its d_i drafts, rows in order) and its settings st (offset: the output
    position of the row's first new token). Drafts are one-hot proposals (n-gram): every new
    token is the plain sampler's draw at its position (sampling/rejection.py)."""
    flat = np.asarray([t for d in drafts for t in d], dtype=np.int64)
    draft_ids = to_device(flat, logits.device)
    out = rejection_sample(logits, st, draft_ids, [len(d) for d in drafts])
    return DraftStepHandle.of_rejection(out)
