"""Data-parallel batch inference on Ray Data: one LLM per actor, `ds.map_batches(...)`.

    ds = ray.data.read_json("prompts.jsonl")
    ds = ds.map_batches(
        NanopagedPredictor,
        fn_constructor_kwargs=dict(model="/models/Qwen3-8B", tensor_parallel_size=2,
                                   sampling_params=dict(temperature=0, max_tokens=256)),
        concurrency=4,      # actors = model replicas, on as many machines as the cluster has
        num_gpus=2,         # per actor: its tensor-parallel ranks
        batch_size=256,
    )

Needs the `ray` extra: pip install "nanopaged[ray]".
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from nanopaged.llm import LLM
from nanopaged.sampling_params import SamplingParams

OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "finish_reason")


class NanopagedPredictor:
    """A Ray Data map_batches class: reads a prompt column (text, or a chat as a list of
    {"role", "content"} messages) and adds generated_text, generated_token_ids and
    finish_reason (of the first completion)."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        prompt_column: str = "prompt",
        **llm_kwargs: Any,
    ) -> None:
        """llm_kwargs go to LLM (tensor_parallel_size, dtype, max_model_len, ...)."""
        if isinstance(sampling_params, Mapping):
            sampling_params = SamplingParams(**sampling_params)
        self.sampling_params = sampling_params or SamplingParams()
        self.prompt_column = prompt_column
        self.llm = LLM(model, **llm_kwargs)

    def __call__(self, batch):
        """batch: a dict of numpy arrays (Ray's default batch format) or a pandas DataFrame."""
        if self.prompt_column not in batch:
            raise ValueError(
                f"the batch has no {self.prompt_column!r} column (columns: {list(batch)}); "
                "pass prompt_column=..."
            )
        prompts = [_as_prompt(p, i) for i, p in enumerate(batch[self.prompt_column])]
        chats = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        outputs: list = [None] * len(prompts)
        params = self.sampling_params
        if texts:
            outs = self.llm.generate([prompts[i] for i in texts], params, use_tqdm=False)
            for i, o in zip(texts, outs):
                outputs[i] = o.outputs[0]
        if chats:
            outs = self.llm.chat([prompts[i] for i in chats], params, use_tqdm=False)
            for i, o in zip(chats, outs):
                outputs[i] = o.outputs[0]
        columns = {
            "generated_text": [c.text for c in outputs],
            "generated_token_ids": [list(c.token_ids) for c in outputs],
            "finish_reason": [c.finish_reason for c in outputs],
        }
        if hasattr(batch, "assign"):  # pandas
            return batch.assign(**columns)
        out = dict(batch)
        for name, values in columns.items():
            arr = np.empty(len(values), dtype=object)
            arr[:] = values
            out[name] = arr
        return out

    def __del__(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()


def _as_prompt(value: Any, index: int) -> str | list[dict[str, str]]:
    """A row's prompt: text as is, a chat (list of messages, as Arrow hands it back) as a list
    of plain dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, (Sequence, np.ndarray)) and all(isinstance(m, Mapping) for m in value):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in value]
    raise TypeError(
        f"prompt of row {index} must be a str or a list of {{'role', 'content'}} messages, "
        f"got {type(value).__name__}"
    )
