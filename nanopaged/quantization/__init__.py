"""Quantized checkpoints: the format read from config.json's quantization_config, one file per
format (fp8.py: block-wise and compressed-tensors FP8; awq.py; gptq.py).

A format says which tensors a quantized linear layer holds and which GEMM runs them: on GPUs
the FP8 or W4A16 kernels, on CPUs the weight dequantized at load into the run dtype. Every
setting nanopaged cannot run is a ValueError naming its field, raised before any weight is read.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from nanopaged.quantization.awq import AwqConfig, parse_awq
from nanopaged.quantization.base import LinearMethod, QuantConfig
from nanopaged.quantization.fp8 import Fp8Config, parse_compressed_tensors, parse_fp8
from nanopaged.quantization.gptq import GptqConfig, parse_gptq

# vLLM's names of the formats nanopaged reads (EngineArgs.quantization / quant_method)
QUANTIZATION_METHODS = ("fp8", "awq", "gptq", "compressed-tensors")
_PARSERS = {
    "fp8": parse_fp8,
    "awq": parse_awq,
    "gptq": parse_gptq,
    "compressed-tensors": parse_compressed_tensors,
}

__all__ = [
    "QUANTIZATION_METHODS", "AwqConfig", "Fp8Config", "GptqConfig", "LinearMethod",
    "QuantConfig", "check_quantization_arg", "linear_method", "parse_quantization_config",
    "weight_bytes",
]  # fmt: skip


def check_quantization_arg(quantization: object, is_gguf: bool) -> None:
    """EngineArgs.quantization: None, a format nanopaged reads, or "gguf" for a .gguf file."""
    if quantization is None:
        return
    allowed = QUANTIZATION_METHODS + (("gguf",) if is_gguf else ())
    if not isinstance(quantization, str) or quantization.lower() not in allowed:
        raise ValueError(
            f"quantization={quantization!r} is not supported: use None (what the checkpoint "
            f"says) or one of {', '.join(map(repr, allowed))}"
            + ("" if is_gguf else " (or a .gguf model file with quantization='gguf')")
        )


def parse_quantization_config(
    quant: object, path: Path | str, architecture: str, expected: str | None = None
) -> QuantConfig | None:
    """config.json's quantization_config (None: a float checkpoint) as a QuantConfig;
    expected: EngineArgs.quantization, which must name the checkpoint's format."""
    if expected is not None:
        expected = expected.lower()
    if quant is None:
        if expected not in (None, "gguf"):
            raise ValueError(
                f"quantization={expected!r} but {path} is not a quantized checkpoint (no "
                "quantization_config); nanopaged does not quantize weights at load: use "
                "quantization=None"
            )
        return None
    if not isinstance(quant, dict):
        raise ValueError(f"quantization_config in {path} must be an object, got {quant!r}")
    method = quant.get("quant_method")
    if not isinstance(method, str) or method.lower() not in _PARSERS:
        raise ValueError(
            f"quantization_config.quant_method in {path} must be one of "
            f"{', '.join(map(repr, QUANTIZATION_METHODS))}, got {method!r}"
        )
    method = method.lower()
    if expected is not None and expected != method:
        raise ValueError(
            f"quantization={expected!r} but {path} is a {method!r} checkpoint: pass "
            f"quantization={method!r} or None"
        )
    if "Moe" in architecture:
        raise ValueError(
            f"{path}: quantized mixture-of-experts checkpoints ({architecture}, "
            f"quant_method {method!r}) are not supported yet"
        )
    return _PARSERS[method](quant, str(path))


def linear_method(quantization: QuantConfig | None, modules: list[str]) -> LinearMethod | None:
    """The quantization method of the linear layer that packs these checkpoint modules (e.g.
    model.layers.0.self_attn.q_proj, k_proj, v_proj); None for float layers."""
    return None if quantization is None else quantization.method_for(modules)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held (quantized tensors at their packed size; a tied
    head counted once): what each decode step reads, and what a quantized checkpoint saves."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
