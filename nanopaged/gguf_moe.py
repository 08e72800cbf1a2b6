"""The mixture-of-experts part of GGUF conversion: `qwen2moe` / `qwen3moe` metadata into HF
config fields, and their router, stacked expert and shared-expert tensors into HF names."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

# GGUF `general.architecture` → HF `architectures`.
MOE_ARCHITECTURES = {
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# Per-layer GGUF tensor → HF module under model.layers.{i}. The *_exps tensors stack every
# expert along their outer axis; split_experts gives each expert its own HF tensor.
ROUTED_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
SHARED_EXPERT_NAMES = {  # Qwen2-MoE only
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# When a file has no expert_weights_norm key: llama.cpp renormalises the top-k weights for
# qwen3moe and not for qwen2moe, matching the published checkpoints (Qwen3-MoE configs say
# norm_topk_prob true, Qwen1.5-MoE / Qwen2-MoE false).
DEFAULT_NORM_TOPK_PROB = {"qwen2moe": False, "qwen3moe": True}


def moe_layer_names(arch: str) -> dict[str, str]:
    """GGUF MoE tensor part → HF module, for the parts architecture `arch` has."""
    return {**ROUTED_NAMES, **(SHARED_EXPERT_NAMES if arch == "qwen2moe" else {})}


def moe_config(arch: str, meta: dict[str, object], tensors: dict) -> dict:
    """The HF config.json fields of the experts, from metadata (or, for widths a file omits,
    layer 0's tensor shapes); ValueError naming the metadata key when one is missing or bad."""

    def key(name: str, low: int, default: int | None = None) -> int:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}")
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"GGUF {arch}.{name} must be an integer >= {low}, got {value!r}")
        return value

    num_experts = key("expert_count", 1)
    top_k = key("expert_used_count", 1)
    if top_k > num_experts:
        raise ValueError(
            f"GGUF {arch}.expert_used_count ({top_k}) exceeds {arch}.expert_count ({num_experts})"
        )
    # GGUF dims are inner-first: ffn_gate_exps is [hidden, moe_intermediate, experts].
    moe_size = key("expert_feed_forward_length", 1, _dim(tensors, "blk.0.ffn_gate_exps", 1))
    norm = meta.get(f"{arch}.expert_weights_norm", DEFAULT_NORM_TOPK_PROB[arch])
    if not isinstance(norm, bool):
        raise ValueError(f"GGUF {arch}.expert_weights_norm must be a bool, got {norm!r}")
    fields = {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": moe_size,
        "norm_topk_prob": norm,
        # GGUF has no decoder_sparse_step / mlp_only_layers: llama.cpp builds every layer of
        # these architectures sparse, and check_moe_tensors refuses a layer without experts.
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if arch == "qwen2moe":
        shared = _dim(tensors, "blk.0.ffn_gate_shexp", 1)
        fields["shared_expert_intermediate_size"] = key(
            "expert_shared_feed_forward_length", 1, shared
        )
    return fields


def check_moe_tensors(arch: str, tensors: dict, config: dict, file_name: str) -> None:
    """Raise ValueError naming the first MoE tensor whose shape disagrees with the config."""
    e, h, i = config["num_experts"], config["hidden_size"], config["moe_intermediate_size"]
    # numpy (outer-first) shapes, as the tensors are converted
    expected = {
        "ffn_gate_inp": [(e, h)],
        "ffn_gate_exps": [(e, i, h)],
        "ffn_up_exps": [(e, i, h)],
        "ffn_down_exps": [(e, h, i)],
    }
    if arch == "qwen2moe":
        s = config["shared_expert_intermediate_size"]
        expected.update({
            "ffn_gate_inp_shexp": [(h,), (1, h)],  # llama.cpp stores the gate as a vector
            "ffn_gate_shexp": [(s, h)],
            "ffn_up_shexp": [(s, h)],
            "ffn_down_shexp": [(h, s)],
        })  # fmt: skip
    for layer in range(config["num_hidden_layers"]):
        for part, shapes in expected.items():
            name = f"blk.{layer}.{part}.weight"
            shape = tuple(int(d) for d in reversed(tensors[name].shape.tolist()))
            if shape not in shapes:
                raise ValueError(
                    f"tensor {name} of {file_name} ({arch}) has shape {shape}, expected "
                    f"{' or '.join(map(str, shapes))} (experts {e}, hidden {h}, "
                    f"moe_intermediate {i})"
                )


def split_experts(hf_name: str, w: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """HF tensors of one converted GGUF tensor: a stacked expert tensor as one per expert, the
    shared expert's gate vector as HF's [1, hidden] row, anything else unchanged."""
    if ".mlp.experts." in hf_name:
        # w: [num_experts, out_features, in_features] → num_experts × [out_features, in_features]
        for expert in range(w.shape[0]):
            yield hf_name.replace(".experts.", f".experts.{expert}."), w[expert]
    elif hf_name.endswith(".shared_expert_gate.weight"):
        yield hf_name, w.reshape(1, -1)
    else:
        yield hf_name, w


def _dim(tensors: dict, name: str, axis: int) -> int | None:
    """GGUF dim `axis` (inner-first) of `<name>.weight`, or None when the file lacks it."""
    tensor = tensors.get(f"{name}.weight")
    return None if tensor is None else int(tensor.shape[axis])
