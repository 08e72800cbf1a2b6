"""AWQ checkpoints (AutoAWQ's "gemm" version): 4-bit weights with a zero and a scale per
group of input rows.

Per layer: qweight int32 [K, N / 8] (eight output columns an int32, in the order 0, 2, 4, 6,
1, 3, 5, 7), qzeros int32 [K / group, N / 8] packed the same way, scales fp16 [K / group, N];
weight[n, k] = (q[k, n] - zero[k // group, n]) * scale[k // group, n].

After loading (each rank's shard, packed parts side by side) qweight and qzeros are repacked
into GPTQ's layout, the one the W4A16 kernels (kernels/w4a16_gemm.py) read: qweight [K / 8, N]
packed along the input, qzeros with column n at nibble n % 8. Both hold the same 4-bit values;
GPTQ's runs faster (a GEMV thread adds eight input rows of one column before reducing, where
AWQ's packs of eight columns cost a reduction each). On CPUs the repacked weight is then
dequantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanopaged.kernels.w4a16_gemm import PACK, Int4Weight
from nanopaged.quantization.base import (
    Axis,
    ConfigReader,
    LinearMethod,
    QuantConfig,
    check_divisible,
    new_param,
)
from nanopaged.quantization.gptq import Int4LinearMethod

# The nibble that holds column j of an AWQ pack of eight output columns (order 0, 2, 4, 6, 1, 3,
# 5, 7 from the lowest nibble up).
AWQ_NIBBLE = tuple((j % 2) * 4 + j // 2 for j in range(PACK))
# qzeros of the dummy weights: zero 8 in every nibble (0x88888888 as an int32)
_ZEROS_8 = 0x88888888 - (1 << 32)


@dataclass(frozen=True)
class AwqConfig(QuantConfig):
    """A 4-bit AWQ checkpoint with its group size."""

    group_size: int
    ignore: tuple[str, ...] = ()
    name: str = "awq"
    skipped_suffixes: tuple[str, ...] = ()

    def new_method(self) -> LinearMethod:
        return AwqLinearMethod(self.group_size)

    def allows(self, name: str, dtype: str) -> bool:
        module, _, leaf = name.rpartition(".")
        return dtype == "I32" and leaf in ("qweight", "qzeros") and self.quantizes(
            f"{module}.weight")  # fmt: skip

    def dummy_tensors(self, module, shape, gen, device, magnitude):
        n, k = shape
        groups = k // self.group_size
        qweight = torch.randint(-(1 << 31), (1 << 31) - 1, (k, n // PACK), generator=gen,
                                dtype=torch.int32, device=device)  # fmt: skip
        return {
            f"{module}.qweight": qweight,
            f"{module}.qzeros": torch.full((groups, n // PACK), _ZEROS_8, dtype=torch.int32,
                                           device=device),
            f"{module}.scales": torch.full((groups, n), magnitude / 8, dtype=torch.float16,
                                           device=device),
        }  # fmt: skip


def _awq_column(packed: torch.Tensor, j: int) -> torch.Tensor:
    """The 4-bit values of column j of each AWQ pack, as int32 of packed's shape."""
    column = packed >> (4 * AWQ_NIBBLE[j])
    return column.bitwise_and_(0xF)  # in place: one temporary of packed's size, not two


def repack_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """AWQ's qweight [K, N / 8] and qzeros [G, N / 8] -> GPTQ's qweight [K / 8, N] (input row
    8 r + i at nibble i of row r) and qzeros [G, N / 8] (column 8 c + j at nibble j), on their
    device. Temporaries stay near one qweight in size: one column of each pack at a time."""
    k, packs = qweight.shape
    assert k % PACK == 0 and qzeros.shape[1] == packs, (qweight.shape, qzeros.shape)
    rows = qweight.view(k // PACK, PACK, packs)  # [K / 8, 8 input rows, N / 8]
    out = torch.zeros(k // PACK, packs, PACK, dtype=torch.int32, device=qweight.device)
    zeros = torch.zeros_like(qzeros)
    for j in range(PACK):  # column j of every pack: 8 steps, each over whole tensors
        column = _awq_column(rows, j)  # [K / 8, 8, N / 8]
        dest = out[:, :, j]  # output column 8 c + j of [K / 8, N]
        for i in range(PACK):
            dest |= column[:, i] << (4 * i)
        del column
        zeros |= _awq_column(qzeros, j) << (4 * j)
    return out.view(k // PACK, packs * PACK), zeros


def parse_awq(cfg: dict, where: str) -> AwqConfig:
    r = ConfigReader(cfg, where)
    r.choice("bits" if "bits" in cfg else "w_bit", (4,))
    r.choice("version", ("gemm",), default="gemm")
    r.choice("zero_point", (True,), default=True)
    group = r.group_size("group_size" if "group_size" in cfg else "q_group_size",
                         allow_whole=False)  # fmt: skip
    return AwqConfig(group, r.names("modules_to_not_convert"))


class AwqLinearMethod(Int4LinearMethod):
    """qweight, qzeros and scales of one (packed, sharded) layer."""

    param_names = ("qweight", "qzeros", "scales")

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def create_weights(self, layer, in_features, out_parts, in_split, out_split) -> None:
        g = self.group_size
        for part in out_parts:
            check_divisible(part, PACK, "a layer's output features (each packed part)",
                            "the 8 values an int32 packs")  # fmt: skip
        check_divisible(in_features, g, "a layer's input features (per rank)", "group_size")
        n, groups = sum(out_parts), in_features // g
        layer.params_dtype = torch.get_default_dtype()
        layer.qweight = new_param((in_features, n // PACK), torch.int32, Axis(1, PACK), Axis(0))
        layer.qzeros = new_param((groups, n // PACK), torch.int32, Axis(1, PACK), Axis(0, g))
        layer.scales = new_param((groups, n), torch.float16, Axis(1), Axis(0, g))

    def int4_weight(self, layer) -> Int4Weight:
        """The layer's weight in the kernels' layout, once after loading; its qweight and
        qzeros are replaced, so each layer's AWQ tensors are freed as it is repacked."""
        in_features = layer.scales.shape[0] * self.group_size
        assert layer.qweight.shape[0] == in_features, "an AWQ layer is repacked once"
        qweight, qzeros = repack_awq(layer.qweight.data, layer.qzeros.data)
        layer.qweight = nn.Parameter(qweight, requires_grad=False)
        layer.qzeros = nn.Parameter(qzeros, requires_grad=False)
        return Int4Weight(layer.qweight, layer.scales, layer.qzeros, self.group_size)
