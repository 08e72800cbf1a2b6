"""Loading is safe: weights only from safetensors or GGUF, nothing unpickled, no model-directory
code imported, a damaged weight file is a clear error naming the file, and a config.json or
tensor dtype nanopaged cannot run is refused, naming the field or tensor, before any weight is
read."""

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

from nanopaged import LLM, SamplingParams, loader

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


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight_is_refused(model_dir, tmp_path, bad):
    # NaN weights made every logit NaN, and the sampler emitted token 0 whatever the request
    # allowed: refused at load, naming the tensor.
    path = _copy(model_dir, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight"][3, 5] = bad
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"weight 'model.layers.0.self_attn.o_proj.weight' in "
                       r".*model.safetensors holds NaN or infinite values"):
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


# ---- config.json fields and tensor dtypes nanopaged cannot run ----------------------------
@pytest.fixture
def no_weight_data_read(monkeypatch):
    """Reading any tensor's data fails the test; the safetensors headers stay readable."""
    real_open = loader.safe_open

    class HeadersOnly:
        def __init__(self, *args, **kwargs) -> None:
            self.file = real_open(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_slice(self, name):
            return self.file.get_slice(name)

        def get_tensor(self, name):
            raise AssertionError(f"the data of weight {name!r} was read")

    monkeypatch.setattr(loader, "safe_open", HeadersOnly)


LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=256)
BAD_CONFIGS = {
    "rope_theta-0": (dict(rope_theta=0), r"rope_theta in .* must be a finite number > 0, got 0"),
    "rope_theta-negative": (dict(rope_parameters=dict(rope_type="default", rope_theta=-5.0)),
                            r"rope_theta in .* must be a finite number > 0, got -5.0"),
    "rope_theta-inf": (dict(rope_theta=float("inf")), r"rope_theta .* > 0, got inf"),
    "rope_theta-text": (dict(rope_theta="1e4"), r"rope_theta .* > 0, got '1e4'"),
    "rope-yarn": (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)),
                  r"rope_scaling type 'yarn' in .* is not supported; nanopaged implements "
                  r"'default', 'llama3'"),
    "rope-linear-legacy-key": (dict(rope_scaling=dict(type="linear", factor=2.0)),
                               r"rope_scaling type 'linear' .* not supported"),
    "rope-dynamic-parameters": (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0)),
                                r"rope_scaling type 'dynamic' .* not supported"),
    "rope-not-an-object": (dict(rope_scaling="yarn"),
                           r"rope_scaling in .* must be an object or null, got 'yarn'"),
    "llama3-no-factor": (dict(rope_parameters={**LLAMA3_ROPE, "factor": None}),
                         r"rope_scaling factor in .* must be a finite number > 0, got None"),
    "llama3-no-original-length": (
        dict(rope_parameters={**LLAMA3_ROPE, "original_max_position_embeddings": 0}),
        r"rope_scaling original_max_position_embeddings .* integer >= 1, got 0"),
    "llama3-freq-factors": (
        dict(rope_parameters={**LLAMA3_ROPE, "low_freq_factor": 4.0, "high_freq_factor": 4.0}),
        r"high_freq_factor \(4.0\) .* must exceed low_freq_factor \(4.0\)"),
    "partial-rotary": (dict(partial_rotary_factor=0.5),
                       r"partial_rotary_factor in .* must be 1.0 .*got 0.5"),
    "layers-0": (dict(num_hidden_layers=0),
                 r"num_hidden_layers in .*config.json must be an integer >= 1, got 0"),
    "layers-negative": (dict(num_hidden_layers=-1), r"num_hidden_layers .* >= 1, got -1"),
    "layers-float": (dict(num_hidden_layers=2.0), r"num_hidden_layers .* >= 1, got 2.0"),
    "layers-bool": (dict(num_hidden_layers=True), r"num_hidden_layers .* >= 1, got True"),
    "heads-3": (dict(num_attention_heads=3),
                r"num_key_value_heads \(2\) in .* must divide num_attention_heads \(3\)"),
    "heads-not-dividing-hidden": (dict(num_attention_heads=3, num_key_value_heads=1),
                                  r"num_attention_heads \(3\) .* must divide hidden_size \(64\)"),
    "heads-0": (dict(num_attention_heads=0), r"num_attention_heads .* >= 1, got 0"),
    "kv-heads-more-than-heads": (dict(num_key_value_heads=8),
                                 r"num_key_value_heads \(8\) .* must divide num_attention_heads"),
    "kv-heads-0": (dict(num_key_value_heads=0), r"num_key_value_heads .* >= 1, got 0"),
    "head_dim-0": (dict(head_dim=0), r"head_dim in .* must be an integer >= 1, got 0"),
    "head_dim-odd": (dict(head_dim=15), r"head_dim \(15\) in .* must be even"),
    "vocab-0": (dict(vocab_size=0), r"vocab_size .* >= 1, got 0"),
    "hidden-negative": (dict(hidden_size=-64), r"hidden_size .* >= 1, got -64"),
    "intermediate-text": (dict(intermediate_size="128"), r"intermediate_size .* got '128'"),
    "max_position-0": (dict(max_position_embeddings=0), r"max_position_embeddings .* got 0"),
    "eps-0": (dict(rms_norm_eps=0), r"rms_norm_eps in .* must be a finite number > 0, got 0"),
    "eps-negative": (dict(rms_norm_eps=-1e-6), r"rms_norm_eps .* > 0, got -1e-06"),
    "tie-text": (dict(tie_word_embeddings="false"),
                 r"tie_word_embeddings in .* must be true or false, got 'false'"),
    "mlp_bias-text": (dict(mlp_bias="no"), r"mlp_bias .* must be true or false, got 'no'"),
    "attention_bias-int": (dict(attention_bias=1), r"attention_bias .* true or false, got 1"),
    "hidden_act-gelu": (dict(hidden_act="gelu"),
                        r"hidden_act 'gelu' in .* is not supported; nanopaged implements 'silu'"),
    "sliding-window-layer-types": (
        dict(layer_types=["full_attention", "sliding_attention"]),
        r"layer_types in .* must list only 'full_attention' \(sliding-window attention"),
    "sliding-window-flag": (dict(use_sliding_window=True, max_window_layers=1),
                            r"use_sliding_window=true in .* \(layers 1..1\): sliding-window"),
    "dtype-int8": (dict(dtype="int8"), r"dtype in .* must be one of float32, float16, bfloat16, "
                   r"got 'int8' \(a quantized checkpoint names its format in "
                   r"quantization_config\)"),
    "quantized-3-bit": (dict(quantization_config=dict(quant_method="gptq", bits=3)),
                        r"quantization_config.bits in .* must be one of 4 for nanopaged, got 3"),
}  # fmt: skip


@pytest.mark.parametrize("bad", list(BAD_CONFIGS), ids=list(BAD_CONFIGS))
def test_bad_config_field_is_named_before_any_weight_is_read(
    model_dir, tmp_path, bad, no_weight_data_read
):
    changes, match = BAD_CONFIGS[bad]
    path = _copy(model_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        LLM(str(path), kv_cache_memory=KV)


def test_supported_rope_and_window_settings_still_load(model_dir, tmp_path, reference):
    # The same model with settings that change nothing: legacy rope keys, window switched off.
    path = _copy(model_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["rope_parameters"]
    cfg.update(rope_theta=10000.0, rope_scaling=None, hidden_act="swish", partial_rotary_factor=1.0,
               use_sliding_window=False, layer_types=["full_attention"] * 2)  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg))
    out = LLM(str(path), kv_cache_memory=KV).generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference[0].outputs[0].token_ids


NOT_FLOAT = {
    "int8": (torch.int8, "I8"),
    "uint8": (torch.uint8, "U8"),
    "int32": (torch.int32, "I32"),
    "bool": (torch.bool, "BOOL"),
    "float8": (torch.float8_e4m3fn, "F8_E4M3"),
}


@pytest.mark.parametrize("kind", list(NOT_FLOAT), ids=list(NOT_FLOAT))
def test_non_float_tensor_is_refused_uncast(model_dir, tmp_path, kind, no_weight_data_read):
    # A quantized checkpoint's integer or 8-bit weights mean nothing without their scales:
    # refused from the header (in the second shard), never cast to float.
    dtype, name = NOT_FLOAT[kind]
    path = _copy(model_dir, tmp_path / "m", skip=("model.safetensors",))
    tensors = load_file(model_dir / "model.safetensors")
    bad = "model.layers.1.mlp.up_proj.weight"
    tensors[bad] = tensors[bad].to(dtype)
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[::2]}, path / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in names[1::2]}, path / "model-00002-of-00002.safetensors")
    shard = next(p for p in path.glob("*.safetensors") if bad in load_file(p))
    with pytest.raises(ValueError, match=rf"weight '{bad}' in {shard} has dtype {name}; nanopaged "
                       r"loads float weights \(F16, BF16, F32, F64\) .*config.json has no "
                       r"quantization_config"):
        LLM(str(path), kv_cache_memory=KV)  # fmt: skip


def test_float64_weights_load(model_dir, tmp_path, reference):
    path = _copy(model_dir, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    save_file({k: v.double() for k, v in tensors.items()}, path / "model.safetensors")
    out = LLM(str(path), kv_cache_memory=KV).generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference[0].outputs[0].token_ids


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
