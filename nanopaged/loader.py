"""Weights from safetensors files into a model's parameters; never unpickles anything."""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nanopaged.layers.linear import default_weight_loader

# Checkpoint entries that carry nothing we use (precomputed rotary tables of old exports).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
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


def _checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor, Path]]:
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name), path
        except SafetensorError as e:
            raise ValueError(f"cannot read weight file {path}: {e}") from e


def _dummy_tensors(
    shapes: dict[str, tuple[int, ...]], seed: int, dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[str, torch.Tensor, str]]:
    for name, shape in shapes.items():
        # One stream per tensor name: every rank draws the same full tensor and keeps its shard.
        stream = seed * 1_000_003 + zlib.crc32(name.encode())
        gen = torch.Generator(device=device).manual_seed(stream)
        tensor = torch.empty(shape, dtype=dtype, device=device)
        yield name, tensor.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=gen), "dummy"


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Copy every checkpoint tensor into its parameter; raise on a missing or unknown name."""
    _load(model, _checkpoint_tensors(model_dir), str(model_dir))


def load_dummy_weights(
    model: nn.Module, shapes: dict[str, tuple[int, ...]], seed: int
) -> None:
    """Fill the model with small uniform random weights (load_format="dummy"), deterministic
    from the seed and the same whatever the tensor-parallel size: `shapes` is the full
    checkpoint's layout, and each tensor goes through its parameter's weight_loader."""
    first = next(model.parameters())
    _load(model, _dummy_tensors(shapes, seed, first.dtype, first.device), "dummy weights")


def _load(
    model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor, object]], where: str
) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    experts = getattr(model, "expert_modules", {})
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    loaded: set[str] = set()
    for name, tensor, path in tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if tied and name == "lm_head.weight":
            continue  # the head is the embedding; some exports still save it
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
