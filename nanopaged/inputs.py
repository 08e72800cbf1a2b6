"""Prompt forms vLLM's offline API takes: text, token ids, TextPrompt and TokensPrompt dicts."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import TypedDict


class TextPrompt(TypedDict):
    """A prompt as text: {"prompt": "..."}."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids: {"prompt_token_ids": [...]}."""

    prompt_token_ids: list[int]


PromptType = str | list[int]  # what a prompt is once its dict form is unwrapped
PromptInput = str | list[int] | TextPrompt | TokensPrompt

_PROMPT_FORMS = (
    "a str, a list of token ids, {'prompt': str}, {'prompt_token_ids': [int, ...]}, or a list "
    "of these"
)


def check_unicode(text: str, name: str) -> None:
    """Text a tokenizer can take: no lone surrogate (which no UTF-8 encodes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{name} is not valid Unicode: {e.reason} at index {e.start} "
            f"({text[e.start:e.end]!r}): text must be encodable as UTF-8"
        ) from None


def _is_token_ids(p: object) -> bool:
    if not isinstance(p, SequenceABC) or isinstance(p, (str, bytes, bytearray)):
        return False
    # Plain ints (the usual case) by their types alone, in C: an element at a time in Python
    # took ~40 ms for the bench's 143k prompt tokens, inside the timed generate.
    types = set(map(type, p))
    if types <= {int}:
        return True
    return all(issubclass(t, int) and not issubclass(t, bool) for t in types)


def _unwrap(p: object, index: int) -> PromptType:
    if isinstance(p, str):
        return p
    if isinstance(p, (bytes, bytearray)):
        raise TypeError(
            f"prompts[{index}] is {type(p).__name__}: pass text (decode it first) or a list of "
            "int token ids"
        )
    if isinstance(p, dict):
        if set(p) == {"prompt"} and isinstance(p["prompt"], str):
            return p["prompt"]
        if set(p) == {"prompt_token_ids"} and _is_token_ids(p["prompt_token_ids"]):
            return list(p["prompt_token_ids"])
        raise TypeError(
            f"prompts[{index}] must be a str or a list of int token ids, or {{'prompt': str}} / "
            "{'prompt_token_ids': [int, ...]} (nanopaged takes no other prompt keys), got keys "
            f"{sorted(map(str, p))}"
        )
    if _is_token_ids(p):
        return list(p)
    raise TypeError(
        f"prompts[{index}] must be a str or a list of int token ids, or a TextPrompt/"
        f"TokensPrompt dict, got {type(p).__name__}"
    )


def normalize_prompts(prompts: object) -> list[PromptType]:
    """prompts in any accepted form -> a list of str or token-id lists (one entry per prompt)."""
    if isinstance(prompts, (str, dict, bytes, bytearray)):
        return [_unwrap(prompts, 0)]
    if not isinstance(prompts, SequenceABC):
        raise TypeError(f"prompts must be {_PROMPT_FORMS}, got {type(prompts).__name__}")
    prompts = list(prompts)
    # A flat list of ints is one prompt of token ids, as in vLLM.
    if prompts and _is_token_ids(prompts):
        return [prompts]
    return [_unwrap(p, i) for i, p in enumerate(prompts)]
