"""Quantized checkpoints (FP8 block / channel / tensor, AWQ, GPTQ) load, and nanopaged's greedy
tokens equal HF transformers' on the same model with the dequantized weights (fp32, CPU);
bad quantization configs and tensors are clear errors before or while loading."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from quant_formats import formats, quantize_gptq, write_quantized, write_with_compressed_tensors
from safetensors.torch import load_file, save_file
from tiny_models import hf_greedy, make_tiny_model

from nanopaged import LLM, SamplingParams
from nanopaged.quantization import weight_bytes

MAX_TOKENS = 16
PROMPT_LENS = (1, 9, 40)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
KV = 1 << 22
FORMATS = formats()


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(n)] for n in PROMPT_LENS]


def _greedy(path: Path, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", kv_cache_memory=KV, **kwargs)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_greedy_matches_hf_on_dequantized_weights(family, fmt, tmp_path):
    name, src = family
    write_quantized(src, tmp_path / "q", tmp_path / "deq", FORMATS[fmt])
    prompts = _prompts()
    expected = hf_greedy(tmp_path / "deq", prompts, MAX_TOKENS)
    assert _greedy(tmp_path / "q", prompts) == expected
    # quantization= names the checkpoint's format, as vLLM spells it
    method = FORMATS[fmt][0]["quant_method"]
    assert _greedy(tmp_path / "q", prompts[:1], quantization=method) == expected[:1]


@pytest.mark.parametrize("strategy", ["channel", "tensor", "block"])
def test_compressed_tensors_library_checkpoint(strategy, tmp_path):
    """An FP8 checkpoint as the compressed-tensors library itself writes it."""
    src = make_tiny_model(tmp_path / "src", "qwen3")
    write_with_compressed_tensors(src, tmp_path / "q", tmp_path / "deq", strategy)
    prompts = _prompts(4)
    assert _greedy(tmp_path / "q", prompts) == hf_greedy(tmp_path / "deq", prompts, MAX_TOKENS)


@pytest.mark.parametrize("fmt", ["fp8-block", "awq", "gptq-asym-desc_act"])
def test_published_group_and_block_sizes(fmt, tmp_path):
    """Group size 128 and 128x128 FP8 blocks, as Qwen's and the hub's checkpoints use."""
    src = make_tiny_model(tmp_path / "src", "qwen3", hidden_size=128, intermediate_size=256,
                          num_key_value_heads=4, head_dim=32)  # fmt: skip
    write_quantized(src, tmp_path / "q", tmp_path / "deq", formats(128, (128, 128))[fmt])
    prompts = _prompts(1)
    assert _greedy(tmp_path / "q", prompts) == hf_greedy(tmp_path / "deq", prompts, MAX_TOKENS)


@pytest.mark.parametrize(
    "family, overrides, fmt",
    [
        ("llama", dict(mlp_bias=True), "gptq-asym-desc_act"),  # row-parallel groups kept whole
        ("qwen2", dict(num_key_value_heads=1), "awq"),  # one KV head copied onto both ranks
        ("qwen3", {}, "fp8-block"),
    ],
    ids=["llama-gptq-desc_act", "qwen2-awq-one-kv-head", "qwen3-fp8-block"],
)
def test_tensor_parallel(family, overrides, fmt, tmp_path):
    src = make_tiny_model(tmp_path / "src", family, **overrides)
    write_quantized(src, tmp_path / "q", tmp_path / "deq", FORMATS[fmt])
    prompts = _prompts(2)
    expected = hf_greedy(tmp_path / "deq", prompts, MAX_TOKENS)
    assert _greedy(tmp_path / "q", prompts, tensor_parallel_size=2) == expected


def test_ignored_layers_stay_float(tmp_path):
    """A layer the config's ignore list names is read as float weights."""
    src = make_tiny_model(tmp_path / "src", "llama")
    cfg, quantize = FORMATS["ct-fp8-channel"]
    cfg = {**cfg, "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$"]}
    write_quantized(src, tmp_path / "q", tmp_path / "deq", (cfg, quantize))
    weights = load_file(tmp_path / "q" / "model.safetensors")
    deq = load_file(tmp_path / "deq" / "model.safetensors")
    name = "model.layers.1.mlp.down_proj"
    weights[f"{name}.weight"] = deq[f"{name}.weight"] = load_file(
        src / "model.safetensors")[f"{name}.weight"]  # fmt: skip
    del weights[f"{name}.weight_scale"]
    save_file(weights, tmp_path / "q" / "model.safetensors", metadata={"format": "pt"})
    save_file(deq, tmp_path / "deq" / "model.safetensors", metadata={"format": "pt"})
    prompts = _prompts(3)
    assert _greedy(tmp_path / "q", prompts) == hf_greedy(tmp_path / "deq", prompts, MAX_TOKENS)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dummy_weights(fmt, tmp_path):
    """load_format="dummy" draws each format's tensors from config.json alone."""
    src = make_tiny_model(tmp_path / "src", "qwen3")
    path = tmp_path / "cfg"
    path.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": FORMATS[fmt][0]}))
    llm = LLM(str(path), load_format="dummy", kv_cache_memory=KV)
    out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == MAX_TOKENS
    # dequantized on the CPU: every projection is a float weight of the float model's size
    float_llm = LLM(str(src), load_format="dummy", kv_cache_memory=KV)
    assert weight_bytes(llm.runner.model) == weight_bytes(float_llm.runner.model)


# ---- errors -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("awq")
    src = make_tiny_model(root / "src", "llama")
    write_quantized(src, root / "q", root / "deq", FORMATS["awq"])
    return root / "q"


def _with_config(src: Path, dst: Path, **quant) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {**cfg["quantization_config"], **quant}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


BAD_CONFIGS = {
    "method": (dict(quant_method="bitsandbytes"),
               r"quant_method .* must be one of 'fp8', 'awq', 'gptq', 'compressed-tensors', "
               r"got 'bitsandbytes'"),
    "bits": (dict(bits=8), r"quantization_config.bits .* must be one of 4 .*got 8"),
    "version": (dict(version="gemv"), r"quantization_config.version .* 'gemm' .*got 'gemv'"),
    "zero_point": (dict(zero_point=False), r"quantization_config.zero_point"),
    "group_size": (dict(group_size=100), r"group_size .* positive multiple of 8, got 100"),
    "group_fits": (dict(group_size=48), r"input features \(per rank\) \(64\) is not a "
                                        r"multiple of group_size \(48\)"),
    "gptq_format": (dict(quant_method="gptq", checkpoint_format="marlin", desc_act=False),
                    r"checkpoint_format .* 'gptq', 'gptq_v2' .*got 'marlin'"),
    "fp8_fmt": (dict(quant_method="fp8", fmt="e5m2"), r"quantization_config.fmt .*'e5m2'"),
    "fp8_block": (dict(quant_method="fp8", weight_block_size=[128]),
                  r"weight_block_size .* \[block_n, block_k\]"),
    "ct_format": (dict(quant_method="compressed-tensors", format="pack-quantized",
                       config_groups={}), r"quantization_config.format .*'pack-quantized'"),
    "not_object": ("awq", r"quantization_config in .* must be an object"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_quantization_config(awq_dir, tmp_path, case, monkeypatch):
    quant, message = BAD_CONFIGS[case]
    path = tmp_path / "m"
    shutil.copytree(awq_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quant if isinstance(quant, str) else {
        **cfg["quantization_config"], **quant}  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg))
    def no_read(*args, **kwargs):
        raise AssertionError("a weight file was opened before the config was checked")

    if case != "group_fits":  # group sizes are checked against each layer, when it is built
        monkeypatch.setattr("nanopaged.loader.safe_open", no_read)
    with pytest.raises(ValueError, match=message):
        LLM(str(path), kv_cache_memory=KV)


def test_quantization_argument(awq_dir, byte_llama):
    with pytest.raises(ValueError, match=r"quantization='gptq' but .* is a 'awq' checkpoint"):
        LLM(str(awq_dir), quantization="gptq", kv_cache_memory=KV)
    with pytest.raises(ValueError, match=r"quantization='fp8' but .* is not a quantized "
                                         r"checkpoint .*does not quantize weights at load"):
        LLM(str(byte_llama), quantization="fp8", kv_cache_memory=KV)  # fmt: skip
    with pytest.raises(ValueError, match=r"quantization='int4' is not supported: use None .*"
                                         r"'fp8', 'awq', 'gptq', 'compressed-tensors'"):
        LLM(str(awq_dir), quantization="int4", kv_cache_memory=KV)  # fmt: skip


def test_quantized_moe_is_refused(tmp_path):
    src = make_tiny_model(tmp_path / "src", "qwen3_moe")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = FORMATS["fp8-block"][0]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"quantized mixture-of-experts checkpoints"):
        LLM(str(src), kv_cache_memory=KV)


def _edit_tensors(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_bad_tensors(awq_dir, tmp_path):
    name = "model.layers.0.self_attn.k_proj"

    def wrong_groups(t):  # scales of group 16 in a group-32 checkpoint
        t[f"{name}.scales"] = torch.cat([t[f"{name}.scales"]] * 2)

    path = _edit_tensors(awq_dir, tmp_path / "groups", wrong_groups)
    with pytest.raises(ValueError, match=rf"cannot load weight '{name}.scales' .*weight shape "
                                         r"\(4, 32\) does not fit \(2, 32\)"):
        LLM(str(path), kv_cache_memory=KV)  # fmt: skip
    path = _edit_tensors(awq_dir, tmp_path / "missing", lambda t: t.pop(f"{name}.qzeros"))
    with pytest.raises(ValueError, match=r"weights missing from .*qkv_proj.qzeros#k"):
        LLM(str(path), kv_cache_memory=KV)

    def int_embedding(t):
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"].to(torch.int32)

    path = _edit_tensors(awq_dir, tmp_path / "int", int_embedding)
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' .* has dtype I32, which "
                                         r"the awq format does not store there"):
        LLM(str(path), kv_cache_memory=KV)  # fmt: skip

    def float_weight(t):  # a float weight where the format stores packed ints
        t[f"{name}.weight"] = torch.zeros(32, 64)

    path = _edit_tensors(awq_dir, tmp_path / "float", float_weight)
    with pytest.raises(ValueError, match=rf"unexpected weight '{name}.weight'"):
        LLM(str(path), kv_cache_memory=KV)


def test_packed_parts_must_agree(tmp_path):
    """q, k and v run as one GEMM: their g_idx must agree, and all or none be quantized."""
    src = make_tiny_model(tmp_path / "src", "llama")
    write_quantized(src, tmp_path / "q", tmp_path / "deq", FORMATS["gptq-asym-desc_act"])
    k = "model.layers.0.self_attn.k_proj"

    def other_order(t):
        w = torch.randn(32, 64)
        t.update({f"{k}.{n}": v for n, v in quantize_gptq(w, 32, False, True, seed=99)[0].items()})

    path = _edit_tensors(tmp_path / "q", tmp_path / "order", other_order)
    with pytest.raises(ValueError, match=r"g_idx of part '[qkv]' differs"):
        LLM(str(path), kv_cache_memory=KV)
    path = _with_config(tmp_path / "q", tmp_path / "mixed", modules_to_not_convert=["k_proj"])
    with pytest.raises(ValueError, match=r"quantizes model.layers.0.self_attn.q_proj, "
                                         r".*v_proj but not .*k_proj"):
        LLM(str(path), kv_cache_memory=KV)  # fmt: skip


def test_nan_in_fp8_weight_is_refused(tmp_path):
    src = make_tiny_model(tmp_path / "src", "llama")
    write_quantized(src, tmp_path / "q", tmp_path / "deq", FORMATS["fp8-block"])
    name = "model.layers.1.mlp.up_proj.weight"

    def nan(t):
        t[name] = t[name].clone()
        t[name].view(torch.uint8)[3, 5] = 0x7F  # e4m3fn's NaN

    path = _edit_tensors(tmp_path / "q", tmp_path / "nan", nan)
    with pytest.raises(ValueError, match=rf"weight '{name}' .* holds NaN or infinite values"):
        LLM(str(path), kv_cache_memory=KV)
