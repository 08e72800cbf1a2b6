"""Engine settings (validated, frozen) and the model's shape read from its config.json."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanopaged.platform import platform_of
from nanopaged.quantization import QuantConfig, parse_quantization_config
from nanopaged.spec.config import SpeculativeConfig, speculative_config

PREEMPTION_MODES = ("recompute", "swap")
LOAD_FORMATS = ("auto", "dummy")
# vLLM's names; "auto" stores K/V in the model's dtype, "fp8" means e4m3.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
_MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape and family flags."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = field(default=())
    # Mixture of experts (0 experts: every layer is dense). Layer i is sparse iff
    # num_experts > 0, i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Qwen2-MoE: one always-on expert of this width, scaled by a sigmoid gate (0: none).
    shared_expert_intermediate_size: int = 0
    # How the checkpoint's linear layers are quantized (nanopaged.quantization); None: float.
    quantization: QuantConfig | None = None

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` uses the MoE block instead of the dense MLP."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dir(
        cls, model_dir: Path, overrides: dict | None = None, quantization: str | None = None
    ) -> ModelConfig:
        """The model directory's config.json with overrides' fields over its own (vLLM's
        hf_overrides), checked (see from_hf_config), with the eos_token_id of its
        generation_config.json when that file sets one; quantization: EngineArgs'."""
        path = model_dir / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        cfg = _read_json_object(path)
        if overrides is not None:
            if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
                raise TypeError(
                    "hf_overrides must be a dict of config.json field names to values, "
                    f"got {type(overrides).__name__}"
                )
            cfg = {**cfg, **overrides}
            path = f"{path} (with hf_overrides {sorted(overrides)})"
        config = cls.from_hf_config(cfg, path, quantization)
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            gen = _read_json_object(gen_path)
            if "eos_token_id" in gen:
                eos_ids = _eos_ids(gen["eos_token_id"], gen_path, config.vocab_size)
                config = dataclasses.replace(config, eos_token_ids=eos_ids)
        return config

    @classmethod
    def from_hf_config(
        cls, cfg: dict, path: Path | str, quantization: str | None = None
    ) -> ModelConfig:
        """A Hugging Face config.json's dict, every field the decoder reads checked for type
        and range, and every feature it does not implement refused (ValueError naming the
        field, `path` and what is allowed), before any weight is read; quantization
        (EngineArgs'), when given, must name the checkpoint's format."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r} in {path}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        quant = parse_quantization_config(cfg.get("quantization_config"), path, arch, quantization)
        f = _Fields(cfg, path)
        missing = [k for k in _REQUIRED_SIZES if cfg.get(k) is None]
        if missing:
            raise ValueError(f"{path} lacks integer {', '.join(missing)}")
        sizes = {k: f.integer(k, 1) for k in _REQUIRED_SIZES}
        hidden, num_heads = sizes["hidden_size"], sizes["num_attention_heads"]
        num_kv_heads = f.integer("num_key_value_heads", 1, default=num_heads)
        if num_kv_heads > num_heads or num_heads % num_kv_heads:
            raise ValueError(
                f"num_key_value_heads ({num_kv_heads}) in {path} must divide "
                f"num_attention_heads ({num_heads})"
            )
        head_dim = f.integer("head_dim", 1, default=None)
        # transformers' LlamaConfig refuses heads that do not divide hidden_size even with an
        # explicit head_dim; the other families only need it to derive head_dim.
        if (head_dim is None or arch == "LlamaForCausalLM") and hidden % num_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) in {path} must divide hidden_size ({hidden})"
            )
        head_dim = head_dim or hidden // num_heads
        if head_dim % 2:
            raise ValueError(
                f"head_dim ({head_dim}) in {path} must be even: rotary embeddings rotate halves"
            )
        f.choice("hidden_act", ("silu", "swish"), default="silu")  # the same function
        _refuse_sliding_window(f, sizes["num_hidden_layers"])
        rope_theta, scaling = _rope(f)
        dtype_key = "dtype" if cfg.get("dtype") else "torch_dtype"  # transformers 5, 4
        dtype_name = cfg.get(dtype_key) or "float32"
        if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
            raise ValueError(
                f"{dtype_key} in {path} must be one of {', '.join(_CHECKPOINT_DTYPES)}, got "
                f"{dtype_name!r} (a quantized checkpoint names its format in quantization_config)"
            )
        return cls(
            architecture=arch,
            vocab_size=sizes["vocab_size"],
            hidden_size=hidden,
            intermediate_size=sizes["intermediate_size"],
            num_layers=sizes["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.number("rms_norm_eps", default=1e-6),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=f.integer("max_position_embeddings", 1, default=4096),
            tie_word_embeddings=f.flag("tie_word_embeddings", False),
            attention_bias=_attention_bias(arch, f),
            mlp_bias=f.flag("mlp_bias", False),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            dtype=_DTYPES[dtype_name],
            eos_token_ids=_eos_ids(cfg.get("eos_token_id"), path, sizes["vocab_size"]),
            **(_moe_fields(f, arch) if arch in _MOE_ARCHITECTURES else {}),
            quantization=quant,
        )


_REQUIRED_SIZES = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"
)  # fmt: skip
# The rope_scaling types layers/rotary.py implements.
ROPE_TYPES = ("default", "llama3")
_CHECKPOINT_DTYPES = ("float32", "float16", "bfloat16")
_ABSENT = object()


class _Fields:
    """Reads a config.json's fields, each checked: ValueError naming the field, the file and
    the allowed values."""

    def __init__(self, cfg: dict, path: Path | str) -> None:
        self.cfg, self.path = cfg, path

    def _get(self, name: str, default: object) -> object:
        value = self.cfg.get(name, _ABSENT)
        return default if value is _ABSENT else value

    def integer(
        self, name: str, low: int, default: object = _ABSENT, value: object = _ABSENT
    ) -> Any:
        """An int >= low; `default` when the field is absent or null (when one is given)."""
        if value is _ABSENT:
            value = self.cfg.get(name)
            if value is None and default is not _ABSENT:
                return default
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} in {self.path} must be an integer >= {low}, got {value!r}")
        return value

    def number(self, name: str, default: float, value: object = _ABSENT) -> float:
        """A finite number > 0."""
        value = self._get(name, default) if value is _ABSENT else value
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0 < value < math.inf
        ):
            raise ValueError(
                f"{name} in {self.path} must be a finite number > 0, got {value!r}"
            )
        return float(value)

    def flag(self, name: str, default: bool) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise ValueError(f"{name} in {self.path} must be true or false, got {value!r}")
        return value

    def choice(
        self, name: str, allowed: tuple[str, ...], default: str, value: object = _ABSENT
    ) -> str:
        value = self._get(name, default) if value is _ABSENT else value
        if value not in allowed:
            raise ValueError(
                f"{name} {value!r} in {self.path} is not supported; nanopaged implements "
                f"{', '.join(map(repr, allowed))}"
            )
        return value


def _refuse_sliding_window(f: _Fields, num_layers: int) -> None:
    """Qwen2/Qwen3 can attend over a sliding window on some layers; nanopaged attends over the
    whole context, so a config that turns the window on is refused."""
    layer_types = f.cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"layer_types in {f.path} must list only 'full_attention' (sliding-window "
                f"attention is not supported), got {layer_types!r}"
            )
        return
    if f.flag("use_sliding_window", False):
        first = f.integer("max_window_layers", 0, default=28)  # transformers' default
        if first < num_layers:
            raise ValueError(
                f"use_sliding_window=true in {f.path} (layers {first}..{num_layers - 1}): "
                "sliding-window attention is not supported"
            )


def _rope(f: _Fields) -> tuple[float, dict | None]:
    """(rope_theta, the scaling parameters, None for plain RoPE), read as transformers 5 reads
    them: rope_scaling (transformers 4's name) when set, else rope_parameters, whose own
    rope_theta and partial_rotary_factor come before the top-level fields."""
    for name in ("rope_scaling", "rope_parameters"):
        value = f.cfg.get(name)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{name} in {f.path} must be an object or null, got {value!r}")
    scaling = dict(f.cfg.get("rope_scaling") or f.cfg.get("rope_parameters") or {})
    # A top-level rope_theta is checked even where rope_parameters' own one takes precedence.
    top_theta = f.number("rope_theta", 10000.0)
    rope_theta = f.number("rope_theta", 10000.0, value=scaling.pop("rope_theta", top_theta))
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling["type"]
    partial = scaling.get("partial_rotary_factor", f.cfg.get("partial_rotary_factor", 1.0))
    if partial is not None and partial != 1.0:
        raise ValueError(
            f"partial_rotary_factor in {f.path} must be 1.0 (partial rotary embeddings are not "
            f"supported), got {partial!r}"
        )
    rope_type = scaling.get("rope_type", "default")
    f.choice("rope_scaling type", ROPE_TYPES, "default", value=rope_type)
    if rope_type == "default":
        return rope_theta, None
    # llama3: the frequencies between the two wavelengths are blended by
    # (context / wavelength - low) / (high - low).
    f.number("rope_scaling factor", 0, value=scaling.get("factor"))
    f.integer("rope_scaling original_max_position_embeddings", 1,
              value=scaling.get("original_max_position_embeddings"))  # fmt: skip
    low = f.number("rope_scaling low_freq_factor", 1.0, value=scaling.get("low_freq_factor", 1.0))
    high = f.number("rope_scaling high_freq_factor", 4.0,
                    value=scaling.get("high_freq_factor", 4.0))  # fmt: skip
    if high <= low:
        raise ValueError(
            f"rope_scaling high_freq_factor ({high}) in {f.path} must exceed low_freq_factor "
            f"({low})"
        )
    return rope_theta, scaling


def _attention_bias(arch: str, f: _Fields) -> bool:
    if arch == "Qwen2ForCausalLM":
        return True
    if arch == "Qwen2MoeForCausalLM":
        return f.flag("qkv_bias", True)  # HF's Qwen2-MoE: q/k/v biases unless told not
    return f.flag("attention_bias", False)


def _moe_fields(f: _Fields, arch: str) -> dict:
    """The mixture-of-experts fields of an MoE config.json, each checked (ValueError naming it)."""
    cfg, path = f.cfg, f.path
    # transformers 5 writes num_local_experts for Qwen3-MoE; published checkpoints num_experts.
    key = "num_experts" if "num_experts" in cfg else "num_local_experts"
    num_experts = f.integer(key, 0)
    top_k = f.integer("num_experts_per_tok", 1)
    if num_experts and top_k > num_experts:
        raise ValueError(
            f"num_experts_per_tok ({top_k}) in {path} exceeds {key} ({num_experts})"
        )
    moe_size = f.integer("moe_intermediate_size", 1)
    step = f.integer("decoder_sparse_step", 1, default=1)
    norm = f.flag("norm_topk_prob", False)
    num_layers = cfg["num_hidden_layers"]
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(
        not isinstance(i, bool) and isinstance(i, int) and 0 <= i < num_layers for i in only
    ):
        raise ValueError(
            f"mlp_only_layers in {path} must be a list of layer indices in [0, {num_layers}), "
            f"got {only!r}"
        )
    shared = 0
    if arch == "Qwen2MoeForCausalLM":
        shared = f.integer("shared_expert_intermediate_size", 0)
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_size,
        norm_topk_prob=norm,
        decoder_sparse_step=step,
        mlp_only_layers=tuple(sorted(set(only))),
        shared_expert_intermediate_size=shared,
    )


def _read_json_object(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(obj).__name__}")
    return obj


def _eos_ids(value: object, path: Path, vocab_size: int) -> tuple[int, ...]:
    """eos_token_id of a config file (null, an id or a list of ids), each inside the vocabulary."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(
                f"eos_token_id in {path} must be null, an int or a list of ints, got {value!r}"
            )
        if not 0 <= t < vocab_size:
            raise ValueError(
                f"eos_token_id {t} in {path} is outside the vocabulary [0, {vocab_size})"
            )
    return tuple(ids)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype | None:
    """'auto' -> None; otherwise a floating torch dtype, or ValueError naming the choices."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str or torch.dtype, got {type(dtype).__name__}")
    if dtype == "auto":
        return None
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def resolve_kv_cache_dtype(kv_cache_dtype: str, device: torch.device) -> torch.dtype | None:
    """The 8-bit torch dtype of an fp8 kv_cache_dtype (None for "auto": the model's dtype);
    ValueError when the device cannot hold or read it."""
    if kv_cache_dtype == "auto":
        return None
    name = "float8_e5m2" if kv_cache_dtype == "fp8_e5m2" else "float8_e4m3fn"
    dtype = getattr(torch, name, None)
    if dtype is None:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} needs torch.{name}, which torch "
            f"{torch.__version__} lacks; use kv_cache_dtype='auto'"
        )
    platform = platform_of(device)
    capability = platform.compute_capability(device)
    if capability is not None and capability < (8, 9):
        major, minor = capability
        gpu = platform.device_name(device)
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} needs a GPU of compute capability >= 8.9 "
            f"(Ada, Hopper or newer) for Triton's fp8 loads; {gpu} has {major}.{minor}; "
            "use kv_cache_dtype='auto'"
        )
    return dtype


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: batching limits, KV block size and budget, device and dtype."""

    max_num_seqs: int = 256
    # nano-vllm's default: a prefill step outside CUDA graphs costs ~25 ms of kernel launches
    # on the host whatever its size, so 8,192 left the bench's prefill bound by the host.
    max_num_batched_tokens: int = 16384
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    seed: int = 0
    max_model_len: int | None = None
    # How a running group gives its blocks back when the cache is full: "recompute" frees
    # them (the group is recomputed later), "swap" moves them to a CPU pool of swap_space GiB.
    preemption_mode: str = "recompute"
    # Plan step N+1 while step N runs on the device; None: on for CUDA.
    async_scheduling: bool | None = None
    swap_space: float = 4.0
    # Ranks the model is split over (heads, MLP and vocabulary); rank 0 is this process.
    tensor_parallel_size: int = 1
    # "auto": the checkpoint's weights; "dummy": random weights of its shapes (benchmarks).
    load_format: str = "auto"
    # "auto": K/V in the model's dtype; "fp8"/"fp8_e4m3"/"fp8_e5m2": 8 bits with scales.
    kv_cache_dtype: str = "auto"
    # An 8-bit cache's per-layer scales from the first forward pass's K/V (else the
    # checkpoint's, else 1.0); no effect with kv_cache_dtype="auto".
    calculate_kv_scales: bool = False
    # The most logprobs / prompt_logprobs a request may ask for (vLLM's default, 20: the
    # OpenAI API's cap); -1: no cap (a vocabulary-wide request costs vocab x tokens entries).
    max_logprobs: int = 20
    # Speculative decoding (n-gram or a draft model); None: none.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        self._check_speculative()
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int):
            raise TypeError(f"max_logprobs must be an int, got {type(self.max_logprobs).__name__}")
        if self.max_logprobs < -1:
            raise ValueError(
                f"max_logprobs must be >= 0, or -1 for no cap, got {self.max_logprobs}"
            )
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if not isinstance(self.calculate_kv_scales, bool):
            raise TypeError(f"calculate_kv_scales must be a bool, got "
                            f"{type(self.calculate_kv_scales).__name__}")  # fmt: skip
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {', '.join(map(repr, LOAD_FORMATS))}, "
                f"got {self.load_format!r}"
            )
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("block_size", self.block_size)
        if self.block_size < 8 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 8, got {self.block_size}")
        if self.kv_cache_memory is not None:
            _positive_int("kv_cache_memory", self.kv_cache_memory)
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(
            self.gpu_memory_utilization, (int, float)
        ):
            raise TypeError("gpu_memory_utilization must be a number")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        for name in ("enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise TypeError(
                "async_scheduling must be True, False or None (on for CUDA), "
                f"got {type(self.async_scheduling).__name__}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {', '.join(map(repr, PREEMPTION_MODES))}, "
                f"got {self.preemption_mode!r}"
            )
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float)):
            raise TypeError(f"swap_space must be a number of GiB, got {self.swap_space!r}")
        if not (0 <= self.swap_space < float("inf")):
            raise ValueError(
                f"swap_space must be a finite number of GiB >= 0, got {self.swap_space}"
            )
        if self.preemption_mode == "swap" and self.swap_space <= 0:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (GiB of CPU memory)")

    def _check_speculative(self) -> None:
        spec = self.speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            raise TypeError(
                f"speculative_config must be a SpeculativeConfig or None (LLM takes a dict), "
                f"got {type(spec).__name__}"
            )
        if spec is not None and self.tensor_parallel_size != 1:
            raise ValueError(
                "speculative_config is not supported with tensor_parallel_size > 1, got "
                f"tensor_parallel_size={self.tensor_parallel_size}"
            )


def _arg(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class EngineArgs:
    """Everything an engine is built from, as LLM's keyword arguments (vLLM's EngineArgs):
    LLM(**dataclasses.asdict(args)), LLM.from_engine_args(args), LLMEngine.from_engine_args(args);
    add_cli_args/from_cli_args make a command line of them."""

    model: str | None = _arg(None, "HF model directory or .gguf file (default: embedded SmolLM2)")
    tokenizer: str | None = _arg(None, "tokenizer directory (default: the model's)")
    tokenizer_mode: str = _arg("auto", "'auto' (fast where one exists) or 'slow'")
    dtype: str = _arg("auto", "auto, float32, bfloat16 or float16")
    device: str = _arg("auto", "auto, cpu or cuda[:N]")
    max_model_len: int | None = _arg(None, "longest prompt + output (default: the model's)")
    max_num_seqs: int = _arg(256, "most sequences in one step")
    max_num_batched_tokens: int = _arg(16384, "most tokens in one step (prefill chunk size)")
    block_size: int = _arg(16, "KV block size in tokens, a power of two >= 8")
    enable_prefix_caching: bool = _arg(True, "reuse KV blocks of identical prefixes")
    kv_cache_memory: int | None = _arg(None, "bytes for the KV cache (default: see README)")
    gpu_memory_utilization: float = _arg(0.9, "share of GPU memory the engine may use")
    enforce_eager: bool = _arg(False, "no CUDA graphs")
    seed: int = _arg(0, "seed of the stream that unseeded sampled requests draw from")
    preemption_mode: str = _arg("recompute", "recompute or swap")
    swap_space: float = _arg(4.0, "GiB of CPU memory for swapped-out KV blocks")
    async_scheduling: bool | None = _arg(None, "plan step N+1 while N runs (default: on CUDA)")
    tensor_parallel_size: int = _arg(1, "GPUs (or CPU processes) the model is split over")
    trust_remote_code: bool = _arg(False, "must stay False: no code from a model directory")
    quantization: str | None = _arg(
        None, "None (the checkpoint's), fp8, awq, gptq, compressed-tensors; gguf for a .gguf"
    )
    generation_config: str = _arg("auto", "'auto' (the model's), 'vllm' or a directory")
    load_format: str = _arg("auto", "'auto' (the checkpoint) or 'dummy' (random weights)")
    kv_cache_dtype: str = _arg("auto", "auto, fp8, fp8_e4m3 or fp8_e5m2")
    calculate_kv_scales: bool = _arg(False, "8-bit KV scales from the first forward pass")
    max_logprobs: int = _arg(20, "most logprobs / prompt_logprobs a request may ask (-1: no cap)")
    enable_chunked_prefill: bool | None = _arg(None, "always on in nanopaged (True or None)")
    task: str = _arg("auto", "'auto' or 'generate'")
    disable_log_stats: bool = _arg(True, "accepted; nanopaged logs no periodic stats")
    hf_overrides: dict | None = _arg(None, "config.json fields to override (a JSON object)")
    speculative_config: dict | None = _arg(
        None, "speculative decoding: vLLM's speculative_config dict (JSON)"
    )

    @classmethod
    def add_cli_args(cls, parser):
        """Add a --flag for every field to an argparse parser (or argument group); returns it."""
        import argparse

        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kwargs: dict[str, Any] = dict(default=f.default, help=f.metadata["help"], dest=f.name)
            kind = f.type.replace(" | None", "")
            if kind == "bool":
                kwargs["action"] = argparse.BooleanOptionalAction
            elif kind == "dict":
                kwargs["type"] = json.loads
            else:
                kwargs["type"] = {"int": int, "float": float, "str": str}[kind]
            parser.add_argument(flag, **kwargs)
        return parser

    def create_engine_config(self) -> EngineConfig:
        """The checked EngineConfig of these arguments (vLLM's name)."""
        return EngineConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager,
            seed=self.seed,
            max_model_len=self.max_model_len,
            preemption_mode=self.preemption_mode,
            swap_space=self.swap_space,
            async_scheduling=self.async_scheduling,
            tensor_parallel_size=self.tensor_parallel_size,
            load_format=self.load_format,
            kv_cache_dtype=self.kv_cache_dtype,
            calculate_kv_scales=self.calculate_kv_scales,
            max_logprobs=self.max_logprobs,
            speculative_config=speculative_config(self.speculative_config),
        )

    @classmethod
    def from_cli_args(cls, args) -> EngineArgs:
        """The EngineArgs of an argparse Namespace made by a parser add_cli_args filled."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
