"""From what users pass (prompts, conversations, SamplingParams) to checked requests: every
check made before any work starts, against this model and engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from pathlib import Path

from nanopaged.config import EngineConfig, ModelConfig
from nanopaged.engine.block_manager import BlockManager
from nanopaged.inputs import PromptType, check_unicode, normalize_prompts
from nanopaged.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class Request:
    """One checked request: its prompt as given (text or token ids), the prompt's token ids and
    its SamplingParams (max_tokens resolved)."""

    prompt: PromptType
    token_ids: list[int]
    params: SamplingParams


def text_parts_joined(conv: object) -> object:
    """A conversation whose list-of-text-parts contents (OpenAI's form) are joined into str;
    anything else is left for the caller's checks."""
    if not isinstance(conv, SequenceABC) or isinstance(conv, str):
        return conv
    out = []
    for m in conv:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(
                part.get("text"), str
            )
            for part in content
        ):
            m = {**m, "content": "".join(part["text"] for part in content)}
        out.append(m)
    return out


def checked_conversations(messages: object) -> list[list[dict]]:
    """LLM.chat's messages as a list of conversations (one, or a list of them), each a
    non-empty list of {'role', 'content'} dicts with str values (text parts joined)."""
    if not isinstance(messages, SequenceABC) or isinstance(messages, str) or not messages:
        raise TypeError(
            "messages must be a non-empty list of {'role', 'content'} dicts, or a list of "
            "such lists"
        )
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    conversations = [text_parts_joined(conv) for conv in conversations]
    for i, conv in enumerate(conversations):
        if not isinstance(conv, SequenceABC) or not conv or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in conv
        ):
            raise TypeError(
                f"conversation {i} must be a non-empty list of dicts with str 'role' and "
                "'content'"
            )
    return conversations


def check_chat_options(
    chat_template: object,
    add_generation_prompt: object,
    continue_final_message: object,
    chat_template_kwargs: object,
) -> None:
    """LLM.chat's template arguments: their types, and flags that do not contradict."""
    flags = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
    }
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message=True continues the last message, so it needs "
            "add_generation_prompt=False"
        )
    if chat_template is not None and not isinstance(chat_template, str):
        raise TypeError(
            f"chat_template must be a Jinja template str, got {type(chat_template).__name__}"
        )
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise TypeError(
            f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}"
        )


class InputProcessor:
    """Checks requests against one model and engine and turns their prompts into token ids."""

    def __init__(
        self,
        tokenizer,
        model_dir: Path,
        model_config: ModelConfig,
        config: EngineConfig,
        max_model_len: int,
        eos_token_ids: set[int],
        block_manager: BlockManager,
        sampling_defaults: dict,
        gpu: bool,
    ) -> None:
        """gpu: the engine runs on a GPU (its cache's size is then a share of its memory)."""
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.model_config = model_config
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_manager = block_manager
        self.sampling_defaults = sampling_defaults
        self.gpu = gpu

    def default_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults."""
        return SamplingParams(**self.sampling_defaults)

    def requests(self, prompts, sampling_params) -> list[Request]:
        """The checked requests of LLM.generate's arguments."""
        prompt_list = normalize_prompts(prompts)
        params = self.normalize_params(sampling_params, len(prompt_list))
        token_lists = [
            self.tokenize(p, i, sp.truncate_prompt_tokens)
            for i, (p, sp) in enumerate(zip(prompt_list, params))
        ]
        params = self.fitted(token_lists, params)
        return [Request(p, ids, sp) for p, ids, sp in zip(prompt_list, token_lists, params)]

    def beam_requests(
        self, prompts, params: BeamSearchParams, bookkeeping: SamplingParams
    ) -> list[Request]:
        """The checked requests of LLM.beam_search's prompts (bookkeeping: the SamplingParams
        their groups carry; beams take candidates from the raw logprobs)."""
        if self.config.speculative_config is not None:
            raise ValueError("beam_search cannot be used with speculative_config; run it on an "
                             "LLM without speculative_config")  # fmt: skip
        prompt_list = normalize_prompts(prompts)
        token_lists = [self.tokenize(p, i) for i, p in enumerate(prompt_list)]
        what = f"beam_width={params.beam_width}"
        for i, ids in enumerate(token_lists):
            self.check_group_fits(len(ids), params.beam_width, params.max_tokens, what, i)
        return [Request(p, ids, bookkeeping) for p, ids in zip(prompt_list, token_lists)]

    def chat_requests(
        self,
        messages,
        sampling_params,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[Request]:
        """The checked requests of LLM.chat's arguments: one per conversation, its prompt the
        rendered template's text."""
        conversations = checked_conversations(messages)
        check_chat_options(
            chat_template, add_generation_prompt, continue_final_message, chat_template_kwargs
        )
        if self.tokenizer is None or not (
            chat_template or getattr(self.tokenizer, "chat_template", None)
        ):
            raise ValueError(
                f"the tokenizer of {self.model_dir} has no chat template; pass chat_template="
            )
        params = self.normalize_params(sampling_params, len(conversations))
        options = (chat_template, add_generation_prompt, continue_final_message,
                   chat_template_kwargs)  # fmt: skip
        texts = [self.render(conv, i, *options) for i, conv in enumerate(conversations)]
        token_lists = [
            self.tokenize(
                self.tokenizer.encode(t, add_special_tokens=False), i, p.truncate_prompt_tokens
            )
            for i, (t, p) in enumerate(zip(texts, params))
        ]
        params = self.fitted(token_lists, params)
        return [Request(t, ids, sp) for t, ids, sp in zip(texts, token_lists, params)]

    def render(
        self,
        conv: list[dict],
        index: int,
        chat_template: str | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict | None,
    ) -> str:
        """Conversation `index`'s prompt text: its messages through the chat template."""
        for j, m in enumerate(conv):
            check_unicode(m["content"], f"conversation {index} message {j} content")
        if continue_final_message and conv[-1]["role"] != "assistant":
            raise ValueError(
                f"conversation {index}: continue_final_message needs a final assistant message, "
                f"got role {conv[-1]['role']!r}"
            )
        return self.tokenizer.apply_chat_template(
            conv,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(chat_template_kwargs or {}),
        )

    def tokenize(
        self, prompt: PromptType, index: int, truncate_prompt_tokens: int | None = None
    ) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"prompts[{index}] is text but no tokenizer was found in {self.model_dir}; "
                    "pass token ids, or tokenizer=PATH"
                )
            check_unicode(prompt, f"prompts[{index}]")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = prompt
        if truncate_prompt_tokens is not None:
            keep = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            token_ids = token_ids[-keep:]
        if not token_ids:
            raise ValueError(f"prompts[{index}] is empty: a prompt needs at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(
                f"prompts[{index}] holds token id {bad}, outside the vocabulary [0, {vocab})"
            )
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"prompts[{index}] has {len(token_ids)} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        return token_ids

    def normalize_params(self, sampling_params, num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.default_params()
        if isinstance(sampling_params, SamplingParams):
            self.check_params(sampling_params, "sampling_params")
            return [sampling_params] * num_prompts
        if isinstance(sampling_params, SequenceABC):
            params = list(sampling_params)
            if len(params) != num_prompts:
                raise ValueError(
                    f"sampling_params has {len(params)} entries but there are {num_prompts} "
                    "prompts; pass one SamplingParams or one per prompt"
                )
            for i, p in enumerate(params):
                if not isinstance(p, SamplingParams):
                    raise TypeError(
                        f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}"
                    )
                self.check_params(p, f"sampling_params[{i}]")
            return params
        raise TypeError(
            "sampling_params must be a SamplingParams or a list of them, "
            f"got {type(sampling_params).__name__}"
        )

    def check_params(self, p: SamplingParams, name: str) -> None:
        """Check p again, now against this model: its fields may have changed since it was made."""
        try:
            p.__post_init__()
        except (ValueError, TypeError) as e:
            raise type(e)(f"{name}: {e}") from None
        if p.min_tokens and p.allowed_token_ids is not None:
            early_stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
            if early_stops.issuperset(p.allowed_token_ids):
                raise ValueError(
                    f"{name}.allowed_token_ids holds only stop tokens (EOS or stop_token_ids), "
                    f"which min_tokens={p.min_tokens} forbids: no token could be sampled; allow "
                    "other tokens, or set min_tokens=0"
                )
        cap = self.config.max_logprobs
        for field_name in ("logprobs", "prompt_logprobs"):
            value = getattr(p, field_name)
            if cap != -1 and value is not None and value > cap:
                raise ValueError(
                    f"{name}.{field_name}={value} is more than max_logprobs={cap}; ask for at "
                    "most max_logprobs, or raise LLM(max_logprobs=...) (-1: no cap)"
                )
        vocab = self.model_config.vocab_size
        bad = next((t for t in p.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(
                f"{name}.stop_token_ids holds {bad}, outside the vocabulary [0, {vocab})"
            )
        for field_name in ("logit_bias", "allowed_token_ids"):
            ids = getattr(p, field_name) or ()
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(
                    f"{name}.{field_name} holds {bad}, outside the vocabulary [0, {vocab})"
                )
        if p.bad_words and self.tokenizer is None:
            raise ValueError(
                f"{name}.bad_words needs a tokenizer, but {self.model_dir} has none; pass "
                "tokenizer=PATH or use logit_bias"
            )
        if p.stop and self.tokenizer is None:
            raise ValueError(
                f"{name}.stop needs a tokenizer to find stop strings, but {self.model_dir} has "
                "none; pass tokenizer=PATH or use stop_token_ids"
            )
        if p.structured_outputs is not None:
            self.check_structured_outputs(p, name)
        if self.config.speculative_config is not None:
            self.config.speculative_config.check_params(p, name)

    def check_structured_outputs(self, p: SamplingParams, name: str) -> None:
        """A grammar needs the `structured` extra and a tokenizer, and its spec must compile
        (checked here, before any work; compiled for the model's tokenizer later)."""
        if self.tokenizer is None:
            raise ValueError(
                f"{name}.structured_outputs needs a tokenizer, but {self.model_dir} has none; "
                "pass tokenizer=PATH"
            )
        try:
            from nanopaged.structured import validate
        except ImportError as e:
            raise ValueError(
                f"{name}.structured_outputs needs llguidance: pip install 'nanopaged[structured]'"
                f" ({e})"
            ) from None
        try:
            validate(p.structured_outputs)
        except ValueError as e:
            raise ValueError(f"{name}.{e}") from None

    def fitted(
        self, token_lists: list[list[int]], params: list[SamplingParams]
    ) -> list[SamplingParams]:
        """params with max_tokens=None made the room left under max_model_len; each request
        checked to fit the engine alone."""
        params = [
            self.with_max_tokens(p, len(prompt_ids)) for prompt_ids, p in zip(token_lists, params)
        ]
        for i, (prompt_ids, p) in enumerate(zip(token_lists, params)):
            width = p.best_of or p.n
            what = f"sampling_params {'n' if width == p.n else 'best_of'}={width}"
            self.check_group_fits(len(prompt_ids), width, p.max_tokens, what, i)
        return params

    def with_max_tokens(self, p: SamplingParams, prompt_len: int) -> SamplingParams:
        """p, or a copy whose max_tokens=None is made the room left under max_model_len."""
        if p.max_tokens is not None:
            return p
        return dataclasses.replace(p, max_tokens=max(1, self.max_model_len - prompt_len))

    def check_group_fits(
        self, prompt_len: int, width: int, max_tokens: int, what: str, index: int
    ) -> None:
        """A request of `width` sequences must fit the engine alone, or it could never run."""
        limits = {
            "max_num_seqs": self.config.max_num_seqs,
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
        }
        for name, limit in limits.items():
            if width > limit:
                raise ValueError(f"prompts[{index}]: {what} exceeds {name}={limit}")
        bm = self.block_manager
        need = width * bm.num_blocks_for(min(prompt_len + max_tokens, self.max_model_len))
        if need > bm.num_blocks:
            knobs = "kv_cache_memory"
            if self.gpu:
                knobs += " or gpu_memory_utilization"
            raise ValueError(
                f"prompts[{index}]: {what} may need {need} KV blocks, more than the cache's "
                f"{bm.num_blocks}; raise {knobs}, or lower max_tokens"
            )
