"""What every checkpoint format provides: which layers it quantizes, the tensors a quantized
linear layer holds (with where their features lie, so the layer's weight_loader can take its
tensor-parallel shard and packed slice of each), and how the layer multiplies by them."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

# The checkpoint projections a format may quantize (the decoder's linear layers); embeddings,
# the LM head and norms stay in float.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Axis:
    """Where a layer's output or input features lie in one of its parameters: the tensor
    dim, and how many features one element along it covers (8 for 4-bit values packed into
    int32, the group or block size for scales)."""

    dim: int
    per: int = 1


def new_param(
    shape: tuple[int, ...], dtype: torch.dtype, out: Axis | None, inp: Axis | None
) -> nn.Parameter:
    """An empty parameter whose out/in features lie along `out` / `inp` (None: the
    parameter is whole on every rank along that axis)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.out_axis, param.in_axis = out, inp
    return param


class LinearMethod:
    """How one quantized linear layer holds, loads and multiplies its weight."""

    # Names of the parameters create_weights registers (checkpoint suffixes, e.g. "qweight").
    param_names: tuple[str, ...] = ()

    def create_weights(
        self, layer: nn.Module, in_features: int, out_parts: list[int], in_split: bool,
        out_split: bool,
    ) -> None:  # fmt: skip
        """Register this rank's parameters on layer: in_features inputs, outputs stacked from
        out_parts (q, k, v or gate, up); in_split / out_split: the inputs / outputs are a
        tensor-parallel shard. ValueError when the shapes cannot hold the format's packing."""
        raise NotImplementedError

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The layer's weight as floats [out, in] of dtype."""
        raise NotImplementedError

    def kernel_available(self, layer: nn.Module) -> bool:
        """Whether this GPU (and torch, Triton) can run the format's kernel on the layer's
        shapes; if not the layer is dequantized instead."""
        raise NotImplementedError

    def prepare_kernels(self, layer: nn.Module) -> None:
        """After loading: the tensors as apply hands them to the kernels."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, in] @ the weight^T -> [tokens, out] in x's dtype (no bias)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module, gpu: bool) -> None:
        """On a GPU the kernels' layout (prepare_kernels); on a CPU (or a GPU without a kernel for
        the format) the weight dequantized into a plain float `weight`, in the dtype the
        layer was built in: the layer is then an unquantized one."""
        if gpu and self.kernel_available(layer):
            self.prepare_kernels(layer)
            return
        weight = self.dequantize(layer, layer.params_dtype)
        for name in self.param_names:
            if hasattr(layer, name):
                delattr(layer, name)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.packed_weight = None  # CPU bf16: pack_model may pack it like any weight
        layer.quant_method = None


class QuantConfig:
    """A checkpoint's quantization: vLLM's name for it, and which layers it covers."""

    # Subclasses are frozen dataclasses holding these fields.
    name: str
    # Module names (substrings) or "re:" patterns of layers the checkpoint left in float.
    ignore: tuple[str, ...]
    # Checkpoint tensors of quantized layers that nanopaged does not use (e.g. static
    # activation scales: activations are always scaled per token, on the fly).
    skipped_suffixes: tuple[str, ...]

    def is_ignored(self, module: str) -> bool:
        """Whether the checkpoint leaves this module (e.g. model.layers.0.mlp.down_proj) float."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif pattern in module:
                return True
        return False

    def method_for(self, modules: list[str]) -> LinearMethod | None:
        """The method of the linear layer that packs these checkpoint modules (q, k, v of a
        layer), None when the checkpoint keeps them in float; ValueError when it quantizes
        some and not others (one GEMM runs them all)."""
        ignored = [self.is_ignored(m) for m in modules]
        if all(ignored):
            return None
        if any(ignored):
            raise ValueError(
                f"the {self.name} checkpoint quantizes "
                f"{', '.join(m for m, i in zip(modules, ignored) if not i)} but not "
                f"{', '.join(m for m, i in zip(modules, ignored) if i)}; nanopaged runs them "
                "as one packed layer, which must be all quantized or all float"
            )
        return self.new_method()

    def new_method(self) -> LinearMethod:
        raise NotImplementedError

    def quantizes(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (a float model's name, e.g. ...q_proj.weight) is
        stored quantized."""
        module, _, leaf = name.rpartition(".")
        return (
            leaf == "weight"
            and module.rpartition(".")[2] in PROJECTIONS
            and ".experts." not in module
            and not self.is_ignored(module)
        )

    def allows(self, name: str, dtype: str) -> bool:
        """Whether a checkpoint tensor of safetensors dtype `dtype` may sit at `name`."""
        raise NotImplementedError

    def dummy_tensors(
        self, module: str, shape: tuple[int, int], gen: torch.Generator, device: torch.device,
        magnitude: float,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """Random checkpoint tensors of one quantized layer (float weight shape [out, in]) by
        name, whose dequantized weight has about the given magnitude (load_format="dummy")."""
        raise NotImplementedError


def check_divisible(size: int, by: int, what: str, field: str) -> None:
    """ValueError unless `by` divides size: `what` names the size, `field` the config value."""
    if size % by:
        raise ValueError(f"{what} ({size}) is not a multiple of {field} ({by})")


_MISSING = object()


class ConfigReader:
    """Reads quantization_config fields, each checked: ValueError naming the field, the
    file and the allowed values."""

    def __init__(self, cfg: dict, where: str) -> None:
        self.cfg, self.where = cfg, where

    def get(self, *names: str, default: object = _MISSING) -> object:
        """The first of names present (formats spell some fields two ways), else default."""
        for name in names:
            if name in self.cfg:
                return self.cfg[name]
        if default is _MISSING:
            raise ValueError(f"quantization_config in {self.where} lacks {names[0]!r}")
        return default

    def choice(self, name: str, allowed: tuple, default: object = _MISSING) -> object:
        value = self.get(name, default=default)
        norm = value.lower() if isinstance(value, str) else value
        if norm not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise ValueError(
                f"quantization_config.{name} in {self.where} must be one of "
                f"{', '.join(map(repr, allowed))} for nanopaged, got {value!r}"
            )
        return norm

    def flag(self, name: str, default: bool) -> bool:
        return bool(self.choice(name, (True, False), default))

    def names(self, *fields: str) -> tuple[str, ...]:
        """A list of module names or patterns (None: empty)."""
        value = self.get(*fields, default=None)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(
                f"quantization_config.{fields[0]} in {self.where} must be a list of module "
                f"names, got {value!r}"
            )
        return tuple(value)

    def group_size(self, *fields: str, allow_whole: bool) -> int:
        """A positive group size (-1, one group over every input, where allow_whole)."""
        value = self.get(*fields)
        ok = isinstance(value, int) and not isinstance(value, bool) and (
            value > 0 and value % 8 == 0 or allow_whole and value == -1
        )  # fmt: skip
        if not ok:
            whole = " or -1" if allow_whole else ""
            raise ValueError(
                f"quantization_config.{fields[0]} in {self.where} must be a positive multiple "
                f"of 8{whole}, got {value!r}"
            )
        return value
