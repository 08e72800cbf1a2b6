"""Weights from safetensors files into a model's parameters; never unpickles anything."""

from __future__ import annotations

import logging
import math
import re
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nanopaged.layers.linear import Linear, default_weight_loader
from nanopaged.platform import platform_of
from nanopaged.quantization import QuantConfig, weight_bytes

logger = logging.getLogger(__name__)

# Checkpoint entries that carry nothing we use: precomputed rotary tables of old exports, and
# the query / softmax-probability scales of checkpoints made for 8-bit attention arithmetic
# (nanopaged attends in 16 or 32 bits).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "self_attn.q_scale", "self_attn.prob_scale")
# Per-layer KV cache scales of checkpoints calibrated for an 8-bit KV cache (llm-compressor,
# ModelOpt): self_attn.k_scale / v_scale, the older single self_attn.kv_scale for both, or
# compressed-tensors' k_proj / v_proj.output_scale. Each is the factor an 8-bit value is
# multiplied by to give K or V back.
_KV_SCALE_NAME = re.compile(
    r"layers\.(\d+)\.self_attn\.(?:(k|v|kv)_scale|(k|v)_proj\.output_scale)$"
)
# The safetensors dtypes of float weights, which a cast to the model's dtype keeps. Any other
# (int8, uint8, int32, bool, float8, ...) belongs to a quantized format, whose values mean
# nothing without their scales.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# load_format="dummy" draws every weight from U(-r, r), as vLLM does: small enough that
# activations stay finite through any depth.
DUMMY_WEIGHT_RANGE = 1e-3
# A mixture-of-experts checkpoint's per-expert tensors: ...mlp.experts.{e}.{projection}.weight
_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")


def safetensors_files(model_dir: Path) -> list[Path]:
    """The *.safetensors of a model directory, or a ValueError saying what is there instead."""
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if pickled:
        raise ValueError(
            f"{model_dir} holds only pickled weights ({', '.join(pickled)}); nanopaged loads "
            "safetensors or GGUF only, since unpickling can run arbitrary code. Convert them "
            "with transformers' save_pretrained(safe_serialization=True)."
        )
    raise ValueError(f"no *.safetensors weights found in {model_dir}")


@contextmanager
def _reading(path: Path) -> Iterator:
    """The open safetensors file; a damaged one is a ValueError naming it."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"cannot read weight file {path}: {e}") from e


def _check_dtype(name: str, dtype: str, path: Path, quant: QuantConfig | None) -> None:
    """ValueError for a tensor that is neither float nor what the quantization format stores
    at `name` (a cast would corrupt it: quantized values mean nothing without their scales)."""
    if dtype in FLOAT_DTYPES or name.endswith(_IGNORED_SUFFIXES):
        return
    if quant is None:
        raise ValueError(
            f"weight {name!r} in {path} has dtype {dtype}; nanopaged loads float weights "
            f"({', '.join(FLOAT_DTYPES)}) and would corrupt these by a cast: config.json has "
            "no quantization_config saying how to read quantized ones"
        )
    if not quant.allows(name, dtype):
        raise ValueError(
            f"weight {name!r} in {path} has dtype {dtype}, which the {quant.name} format does "
            "not store there (nanopaged reads quantized projections only: q/k/v/o_proj, "
            "gate/up/down_proj)"
        )


def _checkpoint_tensors(
    model_dir: Path, quant: QuantConfig | None = None
) -> Iterator[tuple[str, torch.Tensor, Path]]:
    files = safetensors_files(model_dir)
    # Every file's header first: a tensor the loader would refuse costs no read of any data.
    for path in files:
        with _reading(path) as f:
            for name in f.keys():
                _check_dtype(name, f.get_slice(name).get_dtype(), path, quant)
    for path in files:
        with _reading(path) as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                checked = (
                    not name.endswith(_IGNORED_SUFFIXES)
                    and not _KV_SCALE_NAME.search(name)
                    and (tensor.is_floating_point())  # integers (packed 4-bit) are all finite
                )  # fmt: skip
                if checked and not _all_finite(tensor):  # KV scales have checks of their own
                    raise ValueError(
                        f"weight {name!r} in {path} holds NaN or infinite values: the "
                        "checkpoint is damaged (every logit computed through it would be NaN)"
                    )
                yield name, tensor, path


def _all_finite(tensor: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """Whether every element is finite, read in chunks (a bool mask of a whole embedding
    would be hundreds of MB)."""
    flat = tensor.reshape(-1)
    if tensor.element_size() == 1:
        flat = flat.view(torch.uint8)  # 8-bit floats: CPU torch has no isfinite for them
        # e4m3fn's only non-finite codes are NaN, 0x7f and 0xff; e5m2's have all exponent bits
        mask, bad = (0x7F, 0x7F) if tensor.dtype == torch.float8_e4m3fn else (0x7C, 0x7C)
        return not bool(((flat & mask) == bad).any())
    return all(
        bool(torch.isfinite(flat[i : i + chunk]).all()) for i in range(0, flat.numel(), chunk)
    )


def _dummy_tensors(
    shapes: dict[str, tuple[int, ...]],
    seed: int,
    dtype: torch.dtype,
    device: torch.device,
    quant: QuantConfig | None = None,
) -> Iterator[tuple[str, torch.Tensor, str]]:
    for name, shape in shapes.items():
        # One stream per tensor name: every rank draws the same full tensor and keeps its shard.
        stream = seed * 1_000_003 + zlib.crc32(name.encode())
        gen = torch.Generator(device=device).manual_seed(stream)
        if quant is not None and quant.quantizes(name):
            # the format's tensors, dequantizing to about the same range
            module = name.rpartition(".")[0]
            for qname, tensor in quant.dummy_tensors(
                module, shape, gen, device, DUMMY_WEIGHT_RANGE
            ).items():
                yield qname, tensor, "dummy"
            continue
        tensor = torch.empty(shape, dtype=dtype, device=device)
        yield name, tensor.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=gen), "dummy"


def _quantization(model: nn.Module) -> QuantConfig | None:
    return getattr(getattr(model, "config", None), "quantization", None)


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Copy every checkpoint tensor into its parameter; raise on a missing or unknown name."""
    _load(model, _checkpoint_tensors(model_dir, _quantization(model)), str(model_dir))


def load_dummy_weights(
    model: nn.Module, shapes: dict[str, tuple[int, ...]], seed: int
) -> None:
    """Fill the model with small uniform random weights (load_format="dummy"), deterministic
    from the seed and the same whatever the tensor-parallel size: `shapes` is the full
    checkpoint's layout, and each tensor goes through its parameter's weight_loader."""
    first = next(model.parameters())
    tensors = _dummy_tensors(shapes, seed, first.dtype, first.device,
                             _quantization(model))  # fmt: skip
    _load(model, tensors, "dummy weights")


def _kv_scale(
    name: str, tensor: torch.Tensor, path: object, num_layers: int
) -> tuple[int, str, float] | None:
    """(layer, "k" | "v" | "kv", value) when `name` is a checkpoint's KV cache scale, else
    None; ValueError for a scale that cannot be one (not a single positive finite number, or
    of a layer the model lacks)."""
    match = _KV_SCALE_NAME.search(name)
    if match is None:
        return None
    layer, which = int(match.group(1)), match.group(2) or match.group(3)
    if tensor.numel() != 1:
        raise ValueError(
            f"KV cache scale {name!r} in {path} has shape {tuple(tensor.shape)}; nanopaged "
            "takes one scale per layer for K and one for V (a single value)"
        )
    value = float(tensor.float().item())
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"KV cache scale {name!r} in {path} must be positive and finite, "
                         f"got {value}")  # fmt: skip
    if layer >= num_layers:
        raise ValueError(f"KV cache scale {name!r} in {path} names layer {layer}; the model "
                         f"has {num_layers}")  # fmt: skip
    return layer, which, value


def _load(
    model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor, object]], where: str
) -> None:
    """Weights into the model's parameters; KV cache scales into model.checkpoint_kv_scales
    ({layer: {"k": value, "v": value}}, for the runner to use with an 8-bit cache)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    num_layers = getattr(getattr(model, "config", None), "num_layers", 0)
    kv_scales: dict[int, dict[str, float]] = {}
    packed = getattr(model, "packed_modules", {})
    experts = getattr(model, "expert_modules", {})
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    loaded: set[str] = set()
    quant = _quantization(model)
    skipped = _IGNORED_SUFFIXES + (quant.skipped_suffixes if quant is not None else ())
    for name, tensor, path in tensors:
        if name.endswith(skipped):
            continue
        if tied and name == "lm_head.weight":
            continue  # the head is the embedding; some exports still save it
        scale = _kv_scale(name, tensor, path, num_layers)
        if scale is not None:
            layer, which, value = scale
            for part in ("k", "v") if which == "kv" else (which,):
                kv_scales.setdefault(layer, {})[part] = value
            continue
        target, shard_id = name, None
        expert = _EXPERT_NAME.search(name) if experts else None
        if expert is not None and expert.group(2) in experts:
            # Stacked expert tensors: shard (expert index, part of the stacked parameter).
            param_name, part = experts[expert.group(2)]
            target = f"{name[: expert.start()]}.experts.{param_name}"
            shard_id = (int(expert.group(1)), part)
        else:
            for fragment, (packed_name, sid) in packed.items():
                if f".{fragment}." in name:
                    target, shard_id = name.replace(fragment, packed_name), sid
                    break
        param = params.get(target)
        if param is None:
            raise ValueError(f"unexpected weight {name!r} in {path}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"cannot load weight {name!r} of {path}: {e}") from e
        loaded.add(name if shard_id is None else f"{target}#{shard_id}")
    expected: set[str] = set()
    for name in params:
        if tied and name == "lm_head.weight":
            continue
        shard_ids = getattr(params[name], "shard_ids", None)
        if shard_ids is not None:  # a parameter that lists the shards it must receive
            expected.update(f"{name}#{sid}" for sid in shard_ids)
            continue
        module_name = name.rsplit(".", 1)[0]
        shard_ids = [
            sid for frag, (packed_name, sid) in packed.items() if module_name.endswith(packed_name)
        ]
        expected.update(f"{name}#{sid}" for sid in shard_ids) if shard_ids else expected.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"weights missing from {where}: {', '.join(missing[:8])}")
    model.checkpoint_kv_scales = kv_scales
    _finish_quantized(model)


def _finish_quantized(model: nn.Module) -> None:
    """Quantized layers, their tensors loaded: kept for the GPU kernels or dequantized into
    float weights (CPU), as the device's platform decides."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.quant_method is not None]
    if not layers:
        return
    gpu = platform_of(next(model.parameters()).device).gpu
    for layer in layers:
        layer.quant_method.process_weights_after_loading(layer, gpu)
    kept = sum(layer.quant_method is not None for layer in layers)
    logger.info(
        "%s checkpoint: %d of %d quantized layers run quantized (the rest dequantized); "
        "weights hold %.2f GiB", model.config.quantization.name, kept, len(layers),
        weight_bytes(model) / 2**30,
    )  # fmt: skip
