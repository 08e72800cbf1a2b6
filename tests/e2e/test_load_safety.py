"""Loading is safe: weights only from safetensors or GGUF, nothing unpickled, no model-directory
code imported, and a damaged weight file is a clear error naming the file."""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import add_byte_tokenizer, make_tiny_model

from nanopaged import LLM, SamplingParams

KV = 1 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class _OpensAFile:
    """Unpickling this creates the marker file: proof that a pickle was loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    add_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    return LLM(str(model_dir), kv_cache_memory=KV).generate([[1, 2, 3]], GREEDY, use_tqdm=False)


@pytest.fixture
def no_unpickling(monkeypatch):
    """Any unpickling during the test fails it."""

    def forbidden(*args, **kwargs):
        raise AssertionError("something was unpickled")

    for module, name in [(pickle, "load"), (pickle, "loads"), (torch, "load")]:
        monkeypatch.setattr(module, name, forbidden)


def _copy(model_dir: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.name not in skip:
            shutil.copy(f, dst / f.name)
    return dst


# ---- pickles -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth"])
def test_pickled_weights_are_refused_unopened(model_dir, tmp_path, name, no_unpickling):
    marker = tmp_path / "unpickled"
    path = _copy(model_dir, tmp_path / "m", skip=("model.safetensors",))
    (path / name).write_bytes(pickle.dumps(_OpensAFile(marker)))
    with pytest.raises(ValueError, match=rf"holds only pickled weights \({name}\).*safetensors"):
        LLM(str(path), kv_cache_memory=KV)
    assert not marker.exists()


def test_pickle_beside_safetensors_is_ignored(model_dir, tmp_path, reference, no_unpickling):
    marker = tmp_path / "unpickled"
    path = _copy(model_dir, tmp_path / "m")
    (path / "pytorch_model.bin").write_bytes(pickle.dumps(_OpensAFile(marker)))
    (path / "training_args.bin").write_bytes(pickle.dumps(_OpensAFile(marker)))
    out = LLM(str(path), kv_cache_memory=KV).generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert not marker.exists()


def test_no_weights_at_all(model_dir, tmp_path):
    path = _copy(model_dir, tmp_path / "m", skip=("model.safetensors",))
    with pytest.raises(ValueError, match=r"no \*.safetensors weights found in"):
        LLM(str(path), kv_cache_memory=KV)


# ---- damaged safetensors -------------------------------------------------------------------
def _header_len(data: bytes) -> int:
    return int.from_bytes(data[:8], "little")


DAMAGE = {
    "truncated-half": lambda d: d[: len(d) // 2],
    "truncated-last-byte": lambda d: d[:-1],
    "truncated-in-header": lambda d: d[:5],
    "empty": lambda d: b"",
    "garbage-header-length": lambda d: b"\xff" * 8 + d[8:],
    "garbage-header-json": lambda d: d[:8] + b"[" + d[9:],
    "not-safetensors": lambda d: b"PK\x03\x04 a zip, say" + d[20:],
}


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_damaged_safetensors_name_the_file(model_dir, tmp_path, damage):
    path = _copy(model_dir, tmp_path / "m")
    weights = path / "model.safetensors"
    weights.write_bytes(DAMAGE[damage](weights.read_bytes()))
    with pytest.raises(ValueError, match=rf"cannot read weight file {weights}"):
        LLM(str(path), kv_cache_memory=KV)


def test_damaged_shard_is_named(model_dir, tmp_path):
    path = _copy(model_dir, tmp_path / "m", skip=("model.safetensors",))
    tensors = load_file(model_dir / "model.safetensors")
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[::2]}, path / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in names[1::2]}, path / "model-00002-of-00002.safetensors")
    assert LLM(str(path), kv_cache_memory=KV)  # sharded loads
    shard = path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"cannot read weight file {shard}"):
        LLM(str(path), kv_cache_memory=KV)


def test_wrong_shape_names_the_tensor_and_file(model_dir, tmp_path):
    path = _copy(model_dir, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors[
        "model.layers.1.mlp.down_proj.weight"
    ].T.contiguous()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"cannot load weight 'model.layers.1.mlp.down_proj."
                       r"weight' of .*model.safetensors: weight shape \(128, 64\) does not fit"):
        LLM(str(path), kv_cache_memory=KV)  # fmt: skip


def test_missing_and_unexpected_tensors(model_dir, tmp_path):
    path = _copy(model_dir, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    missing = dict(tensors)
    del missing["model.norm.weight"]
    save_file(missing, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"weights missing from .*model.norm.weight"):
        LLM(str(path), kv_cache_memory=KV)
    save_file({**tensors, "model.extra.weight": torch.zeros(2)}, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected weight 'model.extra.weight' in"):
        LLM(str(path), kv_cache_memory=KV)


# ---- damaged GGUF --------------------------------------------------------------------------
@pytest.fixture
def small_gguf(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_tensor("token_embd.weight", np.ones((64, 32), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("keep", [4, 12, 40, 200, -100, -1], ids=lambda k: f"keep{k}")
def test_truncated_gguf_names_the_file(small_gguf, tmp_path, keep):
    data = small_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    with pytest.raises(ValueError, match=rf"cannot read GGUF file {cut}: truncated or corrupted"):
        LLM(str(cut))
    leftovers = list((tmp_path / "cache" / "gguf").iterdir())
    assert leftovers == []  # no half-built cache entry


def test_corrupted_gguf_header_names_the_file(small_gguf, tmp_path):
    data = bytearray(small_gguf.read_bytes())
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data[:4] + (99).to_bytes(4, "little") + data[8:]))  # version 99
    with pytest.raises(ValueError, match=rf"cannot read GGUF file {bad}"):
        LLM(str(bad))
    bad.write_bytes(bytes(data[:8] + (10**12).to_bytes(8, "little") + data[16:]))  # tensor count
    with pytest.raises(ValueError, match=rf"cannot read GGUF file {bad}"):
        LLM(str(bad))


# ---- code in the model directory -----------------------------------------------------------
def _with_remote_code(model_dir: Path, dst: Path, marker: Path, **config_changes) -> Path:
    path = _copy(model_dir, dst)
    evil = f"open({str(marker)!r}, 'w').write('imported')\n"
    for module, cls in [
        ("modeling_evil", "EvilForCausalLM"),
        ("configuration_evil", "EvilConfig"),
        ("tokenization_evil", "EvilTokenizer"),
    ]:
        (path / f"{module}.py").write_text(f"{evil}class {cls}:\n    pass\n")
    (path / "__init__.py").write_text(evil)
    cfg = json.loads((path / "config.json").read_text())
    cfg["auto_map"] = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
    }
    cfg.update(config_changes)
    (path / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((path / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (path / "tokenizer_config.json").write_text(json.dumps(tok))
    return path


def _nothing_imported(marker: Path) -> None:
    assert not marker.exists()
    assert not [m for m in sys.modules if "evil" in m or m.startswith("transformers_modules")]


def test_remote_code_of_a_supported_model_is_never_imported(model_dir, tmp_path, reference):
    marker = tmp_path / "imported"
    path = _with_remote_code(model_dir, tmp_path / "m", marker)
    llm = LLM(str(path), kv_cache_memory=KV)
    out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert llm.generate("hi", GREEDY, use_tqdm=False)[0].outputs[0].text  # tokenizer works
    _nothing_imported(marker)


def test_remote_code_only_model_is_refused_unimported(model_dir, tmp_path):
    marker = tmp_path / "imported"
    path = _with_remote_code(model_dir, tmp_path / "m", marker, architectures=["EvilForCausalLM"])
    with pytest.raises(ValueError, match=r"unsupported architecture \['EvilForCausalLM'\]"):
        LLM(str(path), kv_cache_memory=KV)
    _nothing_imported(marker)


def test_remote_code_tokenizer_is_refused_unimported(model_dir, tmp_path):
    marker = tmp_path / "imported"
    path = _with_remote_code(model_dir, tmp_path / "m", marker, model_type="evil")
    tok = json.loads((path / "tokenizer_config.json").read_text())
    tok.pop("tokenizer_class", None)  # only the remote class could load it
    (path / "tokenizer_config.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"cannot load the tokenizer in .*never runs code"):
        LLM(str(path), kv_cache_memory=KV)
    _nothing_imported(marker)
