"""Model registry keyed by HF `architectures`."""

from __future__ import annotations

from torch import nn

from nanopaged.config import SUPPORTED_ARCHITECTURES, ModelConfig
from nanopaged.distributed.parallel import TensorParallel
from nanopaged.models.llama import DecoderForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    arch: DecoderForCausalLM for arch in SUPPORTED_ARCHITECTURES
}


def build_model(config: ModelConfig, tp: TensorParallel | None = None) -> nn.Module:
    """Instantiate (this rank's share of) config.architecture, weights uninitialised."""
    try:
        cls = MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {config.architecture!r}; "
            f"supported: {', '.join(MODEL_REGISTRY)}"
        ) from None
    return cls(config) if tp is None else cls(config, tp)
