"""FP8 (e4m3) weights: block-wise ("fp8", Qwen's and DeepSeek's: weight_scale_inv per 128x128
tile) and compressed-tensors' float-quantized (weight_scale per output channel or per tensor).

Every scale multiplies: weight = e4m3 * scale (weight_scale_inv is named for the inverse of
the quantizer's divisor, which is the same number). Per-tensor scales load as per-channel
ones (each packed part broadcast over its rows), so a layer holds either block scales
[ceil(N / block_n), ceil(K / block_k)] or channel scales [N, 1], the block (1, K).

On GPUs of compute capability >= 8.9, activations are quantized per token (per 128-wide
group for block scales) on the fly and multiplied in FP8 (kernels/fp8_gemm.py; per-channel
weights at more than DECODE_ROWS rows through torch._scaled_mm's row-wise scaling, 128x128
blocks through torch's block-scaled matmul where the build runs it). Elsewhere
the weight is dequantized at load into the run dtype. Static activation scales (input_scale)
are not used: dynamic per-token scales are at least as accurate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanopaged.kernels import fp8_gemm
from nanopaged.quantization.base import (
    Axis,
    ConfigReader,
    LinearMethod,
    QuantConfig,
    check_divisible,
    new_param,
)

# Rows up to this many take the Triton kernel (split over K for enough programs); more rows
# take torch._scaled_mm for per-channel weights and torch's block-scaled matmul for 128x128
# blocks (where the build runs it).
DECODE_ROWS = 16
STRATEGIES = ("block", "channel", "tensor")


@dataclass(frozen=True)
class Fp8Config(QuantConfig):
    """An FP8 checkpoint: scale strategy, block shape (strategy "block"), scale tensor name."""

    name: str
    strategy: str
    block: tuple[int, int] | None
    scale_name: str
    ignore: tuple[str, ...] = ()
    skipped_suffixes: tuple[str, ...] = (".input_scale",)

    def new_method(self) -> LinearMethod:
        return Fp8LinearMethod(self)

    def allows(self, name: str, dtype: str) -> bool:
        return dtype == "F8_E4M3" and self.quantizes(name)

    def dummy_tensors(self, module, shape, gen, device, magnitude):
        n, k = shape
        weight = torch.empty(n, k, device=device).uniform_(-fp8_gemm.FP8_MAX, fp8_gemm.FP8_MAX,
                                                           generator=gen)  # fmt: skip
        if self.strategy == "block":
            scale_shape = (-(-n // self.block[0]), -(-k // self.block[1]))
        else:
            scale_shape = (n, 1) if self.strategy == "channel" else (1,)
        scale = torch.full(scale_shape, magnitude / fp8_gemm.FP8_MAX, device=device)
        return {f"{module}.weight": weight.to(fp8_gemm.FP8), f"{module}.{self.scale_name}": scale}


def parse_fp8(cfg: dict, where: str) -> Fp8Config:
    """quant_method "fp8" (vLLM's and transformers' FP8 configs)."""
    r = ConfigReader(cfg, where)
    r.choice("fmt", ("e4m3",), default="e4m3")
    r.choice("activation_scheme", ("dynamic", "static"), default="dynamic")
    block = r.get("weight_block_size", default=None)
    ignore = r.names("ignored_layers", "modules_to_not_convert")
    if block is None:  # a per-tensor weight_scale
        return Fp8Config("fp8", "tensor", None, "weight_scale", ignore)
    return Fp8Config("fp8", "block", _block(block, "weight_block_size", where),
                     "weight_scale_inv", ignore)  # fmt: skip


def _block(value: object, field: str, where: str) -> tuple[int, int]:
    ok = isinstance(value, list) and len(value) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value
    )  # fmt: skip
    if not ok:
        raise ValueError(
            f"quantization_config.{field} in {where} must be [block_n, block_k] (positive "
            f"integers), got {value!r}"
        )
    return value[0], value[1]


def parse_compressed_tensors(cfg: dict, where: str) -> Fp8Config:
    """quant_method "compressed-tensors" with its FP8 schemes (float-quantized weights)."""
    r = ConfigReader(cfg, where)
    r.choice("format", ("float-quantized",))
    if r.get("sparsity_config", default=None):
        raise ValueError(f"quantization_config.sparsity_config in {where}: sparse "
                         "compressed-tensors checkpoints are not supported")  # fmt: skip
    groups = r.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError(
            f"quantization_config.config_groups in {where} must hold one group (one scheme "
            f"for every Linear layer), got {groups!r}"
        )
    (group_name, group), = groups.items()
    field = f"config_groups.{group_name}"
    g = ConfigReader(group if isinstance(group, dict) else {}, where)
    if g.get("targets", default=None) != ["Linear"]:
        raise ValueError(f"quantization_config.{field}.targets in {where} must be ['Linear'], "
                         f"got {g.get('targets', default=None)!r}")  # fmt: skip
    weights = ConfigReader(_dict(g.get("weights", default=None), f"{field}.weights", where),
                           where)  # fmt: skip
    _float8(weights, f"{field}.weights")
    strategy = weights.choice("strategy", STRATEGIES)
    block = None
    if strategy == "block":
        block = _block(weights.get("block_structure", default=None),
                       f"{field}.weights.block_structure", where)  # fmt: skip
    activations = g.get("input_activations", default=None)
    if activations is not None:  # scaled per token on the fly, whatever the checkpoint says
        _float8(ConfigReader(_dict(activations, f"{field}.input_activations", where), where),
                f"{field}.input_activations")  # fmt: skip
    return Fp8Config("compressed-tensors", strategy, block, "weight_scale", r.names("ignore"))


def _dict(value: object, field: str, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"quantization_config.{field} in {where} must be an object, got "
                         f"{value!r}")  # fmt: skip
    return value


def _float8(r: ConfigReader, field: str) -> None:
    """A compressed-tensors quantization args object of symmetric 8-bit floats."""
    for name, allowed in (("num_bits", (8,)), ("type", ("float",)), ("symmetric", (True,))):
        value = r.get(name, default=None)
        if value not in allowed:
            raise ValueError(
                f"quantization_config.{field}.{name} in {r.where} must be "
                f"{' or '.join(map(repr, allowed))} (nanopaged reads FP8 e4m3 schemes), "
                f"got {value!r}"
            )


class Fp8LinearMethod(LinearMethod):
    """An e4m3 weight [N, K] and its block or channel scales."""

    def __init__(self, config: Fp8Config) -> None:
        self.config = config
        self.param_names = ("weight", config.scale_name)

    def create_weights(self, layer, in_features, out_parts, in_split, out_split) -> None:
        c = self.config
        n = sum(out_parts)
        layer.params_dtype = torch.get_default_dtype()
        layer.weight = new_param((n, in_features), fp8_gemm.FP8, Axis(0), Axis(1))
        if c.strategy == "block":
            bn, bk = c.block
            if len(out_parts) > 1 or out_split:
                for part in out_parts:
                    check_divisible(part, bn, "a packed or sharded layer's output rows",
                                    "weight_block_size[0]")  # fmt: skip
            if in_split:
                check_divisible(in_features, bk, "a sharded layer's input features",
                                "weight_block_size[1]")  # fmt: skip
            shape = (sum(-(-p // bn) for p in out_parts), -(-in_features // bk))
            scale = new_param(shape, torch.float32, Axis(0, bn), Axis(1, bk))
        else:
            scale = new_param((n, 1), torch.float32, Axis(0), None)
            scale.per_tensor = c.strategy == "tensor"
        setattr(layer, c.scale_name, scale)

    def _block(self, layer: nn.Module) -> tuple[int, int]:
        return self.config.block if self.config.strategy == "block" else (1, layer.weight.shape[1])

    def dequantize(self, layer, dtype):
        scale = getattr(layer, self.config.scale_name)
        return fp8_gemm.dequantize_fp8(layer.weight, scale, self._block(layer), dtype)

    def kernel_available(self, layer) -> bool:
        device = layer.weight.device
        if fp8_gemm.triton is None or torch.cuda.get_device_capability(device) < (8, 9):
            return False  # no FP8 tensor cores
        block_k = self._block(layer)[1]
        return layer.weight.shape[1] % block_k == 0 and block_k % 16 == 0  # groups tile K

    def prepare_kernels(self, layer) -> None:
        n, k = layer.weight.shape
        scale = getattr(layer, self.config.scale_name)
        # torch._scaled_mm takes the per-channel scales as a [1, N] row
        layer.scale_row = scale.view(1, n) if self.config.strategy != "block" else None
        layer.use_scaled_mm = (
            self.config.strategy != "block" and hasattr(torch, "_scaled_mm")
            and n % 16 == 0 and k % 16 == 0
        )  # fmt: skip
        # 128x128 blocks at many rows: torch's block-scaled matmul where this build runs it
        layer.use_block_scaled_mm = (
            self.config.strategy == "block" and self.config.block == fp8_gemm.SCALED_MM_BLOCK
            and n % 16 == 0 and k % 128 == 0
            and fp8_gemm.block_scaled_mm_available(layer.weight.device)
        )  # fmt: skip
        layer.scale_t = (
            fp8_gemm.block_scaled_mm_weight_scale(scale) if layer.use_block_scaled_mm else None
        )

    def apply(self, layer, x):
        x = x.reshape(-1, x.shape[-1])
        x = x if x.stride(-1) == 1 else x.contiguous()
        block = self._block(layer)
        # the block-scaled matmul writes bf16 (the dtype its probe checked)
        if layer.use_block_scaled_mm and x.shape[0] > DECODE_ROWS and x.dtype == torch.bfloat16:
            xq, x_scale = fp8_gemm.per_token_group_quant(x, block[1], column_major_scales=True)
            return fp8_gemm.block_scaled_mm(xq, x_scale, layer.weight, layer.scale_t, x.dtype)
        xq, x_scale = fp8_gemm.per_token_group_quant(x, block[1])
        if layer.use_scaled_mm and x.shape[0] > DECODE_ROWS:
            # row-wise scaling produces bf16 only
            out = torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale, scale_b=layer.scale_row,
                                   out_dtype=torch.bfloat16)  # fmt: skip
            return out.to(x.dtype)
        scale = getattr(layer, self.config.scale_name)
        return fp8_gemm.w8a8_block_gemm(xq, x_scale, layer.weight, scale, block, x.dtype)
