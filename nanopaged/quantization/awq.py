"""AWQ checkpoints (AutoAWQ's "gemm" version): 4-bit weights with a zero and a scale per
group of input rows.

Per layer: qweight int32 [K, N / 8] (eight output columns an int32, in the order 0, 2, 4, 6,
1, 3, 5, 7), qzeros int32 [K / group, N / 8] packed the same way, scales fp16 [K / group, N];
weight[n, k] = (q[k, n] - zero[k // group, n]) * scale[k // group, n]. On GPUs the W4A16
kernel (kernels/w4a16_gemm.py) reads them as they are; on CPUs they are dequantized at load.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def parse_awq(cfg: dict, where: str) -> AwqConfig:
    r = ConfigReader(cfg, where)
    r.choice("bits" if "bits" in cfg else "w_bit", (4,))
    r.choice("version", ("gemm",), default="gemm")
    r.choice("zero_point", (True,), default=True)
    group = r.group_size("group_size" if "group_size" in cfg else "q_group_size",
                         allow_whole=False)  # fmt: skip
    return AwqConfig(group, r.names("modules_to_not_convert"))


class AwqLinearMethod(LinearMethod):
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

    def _weight(self, layer) -> Int4Weight:
        return Int4Weight("awq", layer.qweight, layer.scales, layer.qzeros, self.group_size)

    def dequantize(self, layer, dtype):
        return w4a16_gemm.dequantize_int4(self._weight(layer), dtype).t().contiguous()

    def kernel_available(self, layer) -> bool:
        return w4a16_gemm.triton is not None

    def prepare_kernels(self, layer) -> None:
        layer.int4 = self._weight(layer)

    def apply(self, layer, x):
        x = x.reshape(-1, x.shape[-1])
        return w4a16_gemm.w4a16_gemm(x if x.stride(-1) == 1 else x.contiguous(), layer.int4)
