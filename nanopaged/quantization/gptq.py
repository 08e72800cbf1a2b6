"""GPTQ checkpoints: 4-bit weights packed along the input, a zero and a scale per group.

Per layer: qweight int32 [K / 8, N] (input row 8i + j at nibble j of row i), qzeros int32
[groups, N / 8] (column 8c + j at nibble j), scales fp16 [groups, N], g_idx int32 [K] (the
group of each input row; with desc_act the rows were quantized in order of activation size,
so groups are not runs of rows). checkpoint_format "gptq" (v1) stores zero - 1, "gptq_v2" the
zero itself; symmetric checkpoints hold zero 8 everywhere. group_size -1: one group.

Under tensor parallelism a row-parallel layer with desc_act keeps every group's scales and
zeros (its rows may belong to any group); otherwise each rank keeps its rows' groups.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch

from nanopaged.kernels import w4a16_gemm
from nanopaged.kernels.w4a16_gemm import PACK, Int4Weight
from nanopaged.quantization.base import (
    Axis,
    ConfigReader,
    LinearMethod,
    QuantConfig,
    check_divisible,
    new_param,
)

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class GptqConfig(QuantConfig):
    """A 4-bit GPTQ checkpoint: group size (-1: one group), desc_act, symmetry, format."""

    group_size: int
    desc_act: bool
    sym: bool
    zero_offset: int  # 1 for v1 checkpoints (zero - 1 stored), 0 for v2
    ignore: tuple[str, ...] = ()
    name: str = "gptq"
    # Without desc_act g_idx is row // group_size, which the kernel computes itself.
    skipped_suffixes: tuple[str, ...] = ()

    def new_method(self) -> LinearMethod:
        return GptqLinearMethod(self)

    def allows(self, name: str, dtype: str) -> bool:
        module, _, leaf = name.rpartition(".")
        return dtype == "I32" and leaf in ("qweight", "qzeros", "g_idx") and self.quantizes(
            f"{module}.weight")  # fmt: skip

    def dummy_tensors(self, module, shape, gen, device, magnitude):
        n, k = shape
        group = k if self.group_size == -1 else self.group_size
        groups = k // group
        zero = 8 - self.zero_offset  # every nibble: zero 8
        packed_zero = sum(zero << (4 * j) for j in range(PACK))
        packed_zero -= (1 << 32) if packed_zero >= 1 << 31 else 0
        int32 = dict(dtype=torch.int32, device=device)
        tensors = {
            f"{module}.qweight": torch.randint(-(1 << 31), (1 << 31) - 1, (k // PACK, n),
                                               generator=gen, **int32),
            f"{module}.qzeros": torch.full((groups, n // PACK), packed_zero, **int32),
            f"{module}.scales": torch.full((groups, n), magnitude / 8, dtype=torch.float16,
                                           device=device),
        }  # fmt: skip
        if self.desc_act:
            tensors[f"{module}.g_idx"] = (torch.arange(k, device=device) // group).int()
        return tensors


def parse_gptq(cfg: dict, where: str) -> GptqConfig:
    r = ConfigReader(cfg, where)
    r.choice("bits", (4,))
    fmt = r.choice("checkpoint_format", CHECKPOINT_FORMATS, default="gptq")
    if r.get("dynamic", default=None):
        raise ValueError(f"quantization_config.dynamic in {where}: per-module GPTQ settings "
                         "are not supported")  # fmt: skip
    r.choice("lm_head", (False,), default=False)
    group = r.group_size("group_size", allow_whole=True)
    desc_act = r.flag("desc_act", False)
    config = GptqConfig(group, desc_act, r.flag("sym", True), 1 if fmt == "gptq" else 0,
                        r.names("modules_to_not_convert"))  # fmt: skip
    if not desc_act:  # g_idx is row // group_size
        return dataclasses.replace(config, skipped_suffixes=(".g_idx",))
    return config


class Int4LinearMethod(LinearMethod):
    """What 4-bit layers in the kernels' layout share (GPTQ's, and AWQ's once repacked):
    int4_weight gives the layer's Int4Weight; dequantizing and the W4A16 kernel follow."""

    def int4_weight(self, layer) -> Int4Weight:
        raise NotImplementedError

    def dequantize(self, layer, dtype):
        return w4a16_gemm.dequantize_int4(self.int4_weight(layer), dtype).t().contiguous()

    def kernel_available(self, layer) -> bool:
        return w4a16_gemm.triton is not None

    def prepare_kernels(self, layer) -> None:
        layer.int4 = w4a16_gemm.without_constant_zeros(self.int4_weight(layer))

    def apply(self, layer, x):
        x = x.reshape(-1, x.shape[-1])
        return w4a16_gemm.w4a16_gemm(x if x.stride(-1) == 1 else x.contiguous(), layer.int4)


class GptqLinearMethod(Int4LinearMethod):
    """qweight, qzeros, scales (and g_idx with desc_act) of one (packed, sharded) layer."""

    param_names = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, config: GptqConfig) -> None:
        self.config = config

    def create_weights(self, layer, in_features, out_parts, in_split, out_split) -> None:
        c = self.config
        for part in out_parts:
            check_divisible(part, PACK, "a layer's output features (each packed part)",
                            "the 8 values an int32 packs")  # fmt: skip
        check_divisible(in_features, PACK, "a layer's input features (per rank)",
                        "the 8 values an int32 packs")  # fmt: skip
        full_in = in_features * layer.tp.size if in_split else in_features
        group = full_in if c.group_size == -1 else c.group_size
        check_divisible(full_in, group, "a layer's input features", "group_size")
        # Each rank's groups are its own unless groups span ranks (-1) or rows pick any (desc_act).
        whole = c.desc_act or c.group_size == -1
        if not whole:
            check_divisible(in_features, group, "a layer's input features (per rank)",
                            "group_size")  # fmt: skip
        self.group = group
        groups = (full_in if whole else in_features) // group
        in_groups = None if whole else Axis(0, group)
        n = sum(out_parts)
        layer.params_dtype = torch.get_default_dtype()
        layer.qweight = new_param((in_features // PACK, n), torch.int32, Axis(1), Axis(0, PACK))
        layer.qzeros = new_param((groups, n // PACK), torch.int32, Axis(1, PACK), in_groups)
        layer.scales = new_param((groups, n), torch.float16, Axis(1), in_groups)
        if c.desc_act:
            layer.g_idx = new_param((in_features,), torch.int32, None, Axis(0))
            layer.g_idx.weight_loader = partial(self._load_g_idx, layer)
            self.g_idx_parts = 0

    def _load_g_idx(self, layer, param, loaded, shard_id=None) -> None:
        """Packed parts (q, k, v) share their input and so their g_idx: each must agree."""
        before = param.data.clone() if self.g_idx_parts else None
        layer.weight_loader(param, loaded, shard_id)
        if before is not None and not torch.equal(before, param.data):
            raise ValueError(
                f"g_idx of part {shard_id!r} differs from the other parts' of the same packed "
                "layer; they share an input, so GPTQ orders their rows alike"
            )
        self.g_idx_parts += 1

    def int4_weight(self, layer) -> Int4Weight:
        return Int4Weight(layer.qweight, layer.scales, layer.qzeros, self.group,
                          getattr(layer, "g_idx", None), self.config.zero_offset)  # fmt: skip
