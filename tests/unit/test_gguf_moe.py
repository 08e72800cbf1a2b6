"""GGUF qwen2moe / qwen3moe files: converted, loaded by `LLM(path)` and checked against HF
transformers on the same weights; files missing expert tensors or keys refused by name."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from test_gguf import PROMPTS, add_metadata, cache_dir, finish, greedy, tiny_model  # noqa: F401
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

from nanopaged import LLM, SamplingParams
from nanopaged import gguf as npg

Q = gguf.GGMLQuantizationType
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
# arch -> (HF config class, its tiny overrides)
MODELS = {
    # head_dim 32 != hidden / heads (16): it must come from attention.key_length
    "qwen3moe": (Qwen3MoeConfig, dict(MOE, head_dim=32, norm_topk_prob=True)),
    "qwen2moe": (Qwen2MoeConfig,
                 dict(MOE, num_experts_per_tok=3, shared_expert_intermediate_size=48)),
}  # fmt: skip
# Quantized files: experts in two block formats, the rest of the MoE block in F16.
QUANT_TYPES = {"ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q8_0, "ffn_down_exps": Q.Q5_0,
               "ffn_gate_inp": Q.F16, "ffn_gate_shexp": Q.F16, "ffn_up_shexp": Q.F16,
               "ffn_down_shexp": Q.F16}  # fmt: skip
_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def save_tiny_moe(arch: str, folder: Path, **overrides) -> Path:
    """A tiny random HF MoE model (random norms and biases too) saved as safetensors."""
    config_cls, moe = MODELS[arch]
    model = tiny_model(arch, tie=False, config_cls=config_cls, **{**moe, **overrides})
    model.save_pretrained(folder)
    return folder


def write_moe_gguf(
    hf_dir: Path,
    arch: str,
    path: Path,
    quantize: bool = False,
    meta: dict[str, object] | None = None,
    edit: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> dict[str, np.ndarray]:
    """Write a saved HF MoE model as llama.cpp lays it out: per-expert tensors stacked into
    [experts, out, in] (GGUF dims [in, out, experts]), the shared expert's gate a vector.
    `meta` replaces expert keys (None: left out), `edit` changes the tensors before writing.
    Returns the HF tensors as the file holds them (quantized ones dequantized)."""
    config = json.loads((hf_dir / "config.json").read_text())
    hf = load_file(str(hf_dir / "model.safetensors"))
    stacked: dict[str, dict[int, np.ndarray]] = {}
    tensors: dict[str, np.ndarray] = {}
    for name, w in hf.items():
        if m := _EXPERT.fullmatch(name):
            stacked.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = w
        else:
            tensors[name] = w
    for name, experts in stacked.items():
        tensors[name] = np.stack([experts[e] for e in range(len(experts))])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    out = {names.get_name(n, try_suffixes=(".weight", ".bias")): w for n, w in tensors.items()}
    for name in out:
        if "ffn_gate_inp_shexp" in name:
            out[name] = out[name].reshape(-1)  # llama.cpp keeps the shared expert's gate 1-D
    if edit is not None:
        edit(out)

    writer = gguf.GGUFWriter(str(path), arch)
    add_metadata(writer, _Config(config), arch)
    # transformers 5 saves Qwen3-MoE's expert count as num_local_experts
    experts = config.get("num_experts") or config["num_local_experts"]
    keys = {"expert_count": experts,
            "expert_used_count": config["num_experts_per_tok"],
            "expert_feed_forward_length": config["moe_intermediate_size"]}  # fmt: skip
    if arch == "qwen2moe":
        keys["expert_shared_feed_forward_length"] = config["shared_expert_intermediate_size"]
    for key, value in {**keys, **(meta or {})}.items():
        if value is not None:
            getattr(writer, f"add_{key}")(value)
    held: dict[str, np.ndarray] = {}
    for name, w in out.items():
        qtype = QUANT_TYPES.get(name.split(".")[-2]) if quantize else None
        if qtype is None:
            writer.add_tensor(name, w)
            held[name] = w
        else:
            raw = gguf.quants.quantize(w, qtype)
            writer.add_tensor(name, raw, raw_dtype=qtype)
            held[name] = gguf.quants.dequantize(raw, qtype).reshape(w.shape)
    finish(writer)
    return _as_hf(held, names, hf) if edit is None else {}


class _Config:
    """An HF config.json dict read as attributes, as add_metadata expects a config."""

    def __init__(self, cfg: dict) -> None:
        self.__dict__.update(cfg)


def _as_hf(held: dict[str, np.ndarray], names, hf: dict[str, np.ndarray]) -> dict:
    """The HF per-expert tensors of GGUF tensors `held`, checked to cover checkpoint `hf`."""
    out = {}
    for name, w in hf.items():
        if m := _EXPERT.fullmatch(name):
            stacked = names.get_name(f"{m[1]}.{m[3]}.weight", try_suffixes=(".weight",))
            out[name] = held[stacked][int(m[2])]
        else:
            out[name] = held[names.get_name(name, try_suffixes=(".weight", ".bias"))]
        out[name] = out[name].reshape(w.shape)
    return out


def hf_reference(hf_dir: Path, weights: dict[str, np.ndarray], folder: Path, **kw):
    """HF's model of `hf_dir`'s config holding exactly `weights`, fp32 on CPU."""
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text((hf_dir / "config.json").read_text())
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()


def llm_greedy(path: Path) -> list[list[int]]:
    llm = LLM(path, device="cpu", kv_cache_memory=1 << 22, block_size=8)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {arch: save_tiny_moe(arch, tmp_path_factory.mktemp(arch)) for arch in MODELS}


@pytest.mark.parametrize("quantize", [False, True], ids=["f32", "quantized"])
@pytest.mark.parametrize("arch", list(MODELS))
def test_moe_gguf_matches_hf(arch: str, quantize: bool, hf_dirs: dict, tmp_path: Path) -> None:
    hf_dir = hf_dirs[arch]
    path = tmp_path / f"tiny-{arch}.gguf"
    weights = write_moe_gguf(hf_dir, arch, path, quantize=quantize)
    original = load_file(str(hf_dir / "model.safetensors"))
    changed = {n for n in original if not np.array_equal(original[n], weights[n])}
    experts = {n for n in original if ".experts." in n}
    # quantized: every expert tensor really rounded, so only a dequantizing reader can match
    assert (experts <= changed) if quantize else not changed

    converted = npg.resolve_model(path)
    ours = load_file(str(converted / npg.WEIGHTS))
    assert sorted(ours) == sorted(weights)  # per-expert HF names, none missing or extra
    for name, w in ours.items():
        np.testing.assert_array_equal(w, weights[name], err_msg=name)
    config = json.loads((converted / "config.json").read_text())
    _, moe = MODELS[arch]
    assert {k: config[k] for k in moe} == moe
    assert config["norm_topk_prob"] == (arch == "qwen3moe")  # no key: each arch's convention
    assert (config["decoder_sparse_step"], config["mlp_only_layers"]) == (1, [])

    reference = hf_reference(hf_dir, weights, tmp_path / "reference")
    expected = [greedy(reference, p) for p in PROMPTS]
    assert llm_greedy(path) == expected
    assert len({t for seq in expected for t in seq}) > 3  # not a degenerate repeat
    if arch == "qwen3moe":  # the tokens depend on norm_topk_prob, so a wrong flag would show
        flipped = hf_reference(hf_dir, weights, tmp_path / "flipped", norm_topk_prob=False)
        assert [greedy(flipped, p) for p in PROMPTS] != expected
    if not quantize:  # transformers' own reading of the same file agrees
        # (told the expert widths: its GGUF config mapping skips expert_*feed_forward_length)
        widths = {k: v for k, v in moe.items() if k.endswith("intermediate_size")}
        theirs = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, **widths
        ).eval()
        assert [greedy(theirs, p) for p in PROMPTS] == expected


def test_expert_weights_norm_key_is_read(tmp_path: Path) -> None:
    """A qwen2moe file that says expert_weights_norm=true renormalises the top-k weights."""
    hf_dir = save_tiny_moe("qwen2moe", tmp_path / "hf", norm_topk_prob=True)
    path = tmp_path / "norm.gguf"
    weights = write_moe_gguf(hf_dir, "qwen2moe", path, meta={"expert_weights_norm": True})
    expected = [greedy(hf_reference(hf_dir, weights, tmp_path / "ref"), p) for p in PROMPTS]
    flipped = hf_reference(hf_dir, weights, tmp_path / "flipped", norm_topk_prob=False)
    assert [greedy(flipped, p) for p in PROMPTS] != expected
    assert llm_greedy(path) == expected


def _drop(name: str) -> Callable[[dict], None]:
    return lambda tensors: tensors.pop(name)


def _dense_layer_1(tensors: dict) -> None:
    """Layer 1 as a dense MLP: what a file with mlp_only_layers would hold."""
    for part in ("gate", "up", "down"):
        experts = tensors.pop(f"blk.1.ffn_{part}_exps.weight")
        tensors[f"blk.1.ffn_{part}.weight"] = experts[0]
    del tensors["blk.1.ffn_gate_inp.weight"]


def _add_shared_expert(tensors: dict) -> None:
    tensors["blk.0.ffn_gate_shexp.weight"] = np.ones((4, 64), np.float32)


def _narrow_down_exps(tensors: dict) -> None:
    name = "blk.1.ffn_down_exps.weight"
    tensors[name] = np.ascontiguousarray(tensors[name][:, :, :16])


@pytest.mark.parametrize(
    "arch, meta, edit, match",
    [
        ("qwen3moe", None, _drop("blk.1.ffn_up_exps.weight"),
         r"lacks tensors: \['blk\.1\.ffn_up_exps\.weight'\]"),
        ("qwen3moe", None, _drop("blk.0.ffn_gate_inp.weight"),
         r"lacks tensors: \['blk\.0\.ffn_gate_inp\.weight'\]"),
        ("qwen2moe", None, _drop("blk.1.ffn_gate_inp_shexp.weight"),
         r"lacks tensors: \['blk\.1\.ffn_gate_inp_shexp\.weight'\]"),
        ("qwen3moe", None, _dense_layer_1,
         r"lacks tensors: \['blk\.1\.ffn_gate_inp\.weight', 'blk\.1\.ffn_gate_exps\.weight'"),
        ("qwen3moe", None, _add_shared_expert,
         r"cannot map: \['blk\.0\.ffn_gate_shexp\.weight'\]"),
        ("qwen3moe", {"expert_count": None}, None, r"lacks qwen3moe\.expert_count"),
        ("qwen2moe", {"expert_used_count": 9}, None,
         r"qwen2moe\.expert_used_count \(9\) exceeds qwen2moe\.expert_count \(8\)"),
        ("qwen3moe", {"expert_count": 6}, None,
         r"blk\.0\.ffn_gate_inp\.weight .* shape \(8, 64\), expected \(6, 64\)"),
        ("qwen2moe", {"expert_shared_feed_forward_length": 40}, None,
         r"blk\.0\.ffn_gate_shexp\.weight .* shape \(48, 64\), expected \(40, 64\)"),
        ("qwen3moe", None, _narrow_down_exps,
         r"blk\.1\.ffn_down_exps\.weight .* \(8, 64, 16\), expected \(8, 64, 32\)"),
    ],
    ids=["missing-experts", "missing-router", "missing-shared-gate", "dense-layer",
         "shared-expert-in-qwen3moe", "no-expert-count", "top-k-too-large", "expert-count-wrong",
         "shared-width-wrong", "expert-width-wrong"],
)  # fmt: skip
def test_bad_moe_gguf(arch: str, meta, edit, match: str, hf_dirs: dict, tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    write_moe_gguf(hf_dirs[arch], arch, path, meta=meta, edit=edit)
    with pytest.raises(ValueError, match=match):
        LLM(path, device="cpu", kv_cache_memory=1 << 22)
    assert list((npg.cache_root() / "gguf").iterdir()) == []  # no entry, no temp build left
