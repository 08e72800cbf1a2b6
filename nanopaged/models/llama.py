"""One decoder for Llama, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm) and their mixture-of-experts
variants (the MoE block in place of the MLP on sparse layers): they differ by flags."""

from __future__ import annotations

import torch
from torch import nn

from nanopaged.attention import Attention, AttentionMetadata
from nanopaged.config import ModelConfig
from nanopaged.distributed.parallel import TensorParallel
from nanopaged.layers.activation import SiluAndMul
from nanopaged.layers.embedding import LMHead, VocabEmbedding
from nanopaged.layers.linear import (
    SINGLE,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from nanopaged.layers.moe import EXPERT_PARAMS, SparseMoeBlock
from nanopaged.layers.norm import RMSNorm
from nanopaged.layers.rotary import RotaryEmbedding
from nanopaged.quantization import linear_method


class DecoderAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallel, prefix: str = ""
    ) -> None:
        super().__init__()
        # prefix: the checkpoint's name of this module (its quantized layers are found by it)
        quant = config.quantization
        names = [f"{prefix}.{p}" for p in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            config.attention_bias,
            tp,
            linear_method(quant, names),
        )
        # This rank's heads: its share of the queries and the KV heads they use.
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        # Left unreduced: the post-attention norm sums it over the ranks.
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, False, tp, reduce_results=False,
            quant_method=linear_method(quant, [f"{prefix}.o_proj"]),
        )  # fmt: skip
        self.rotary = rotary
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(
            self.num_heads, config.head_dim, self.num_kv_heads, config.head_dim**-0.5
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # qkv: [num_tokens, q_size + 2 * kv_size]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # Rotary (after Qwen3's per-head q/k norms), the K/V store and attention: which of them
        # run fused is the attention backend's business.
        out = self.attn(positions, q, k, v, meta, self.rotary, self.q_norm, self.k_norm)
        # out: [num_tokens, num_heads, head_dim] -> [num_tokens, hidden_size] (this rank's part)
        return self.o_proj(out.reshape(-1, self.q_size))


class DecoderMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, prefix: str = "") -> None:
        super().__init__()
        size, quant = config.intermediate_size, config.quantization
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], [0, 1], bias=config.mlp_bias, tp=tp,
            quant_method=linear_method(quant, [f"{prefix}.gate_proj", f"{prefix}.up_proj"]),
        )  # fmt: skip
        # Left unreduced: the next layer's input norm (or the final norm) sums it.
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, config.mlp_bias, tp, reduce_results=False,
            quant_method=linear_method(quant, [f"{prefix}.down_proj"]),
        )  # fmt: skip
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def sparse_moe_block(config: ModelConfig, tp: TensorParallel) -> SparseMoeBlock:
    c = config
    return SparseMoeBlock(
        c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
        c.norm_topk_prob, c.shared_expert_intermediate_size, tp, reduce_results=False,
    )  # fmt: skip


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer: int, rotary: RotaryEmbedding, tp: TensorParallel
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}"
        self.self_attn = DecoderAttention(config, rotary, tp, f"{prefix}.self_attn")
        sparse = config.is_sparse_layer(layer)
        mlp = f"{prefix}.mlp"
        self.mlp = sparse_moe_block(config, tp) if sparse else DecoderMLP(config, tp, mlp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tp = tp

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # hidden: the embeddings (residual None) or the previous layer's MLP output. Under
        # tensor parallelism the attention and MLP outputs are each rank's part of a sum, and
        # the norm after each sums them (with the residual add, in one kernel on CUDA).
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, self.tp)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual, self.tp)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            [DecoderLayer(config, i, rotary, tp) for i in range(config.num_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tp = tp

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual, self.tp)
        return hidden


class DecoderForCausalLM(nn.Module):
    """Llama-family causal LM: hidden states for every token, logits for the rows asked.

    Under tensor parallelism (tp) this is one rank's share; logits come back on rank 0 only.
    """

    # checkpoint name fragment -> (our packed parameter fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # mlp.experts.{e}.<name>.weight -> (stacked parameter of mlp.experts, part), shard (e, part)
    expert_modules = EXPERT_PARAMS

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, tp)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def compute_local_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This rank's vocabulary shard of the logits, and the token id of its first column."""
        return self.lm_head.local_logits(hidden), self.lm_head.vocab_start


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of this config holds, with its full shape."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size)
    }
    for i in range(c.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        layer = {
            f"{attn}.q_proj.weight": (q, c.hidden_size),
            f"{attn}.k_proj.weight": (kv, c.hidden_size),
            f"{attn}.v_proj.weight": (kv, c.hidden_size),
            f"{attn}.o_proj.weight": (c.hidden_size, q),
            **(_moe_shapes(c, mlp) if c.is_sparse_layer(i) else _mlp_shapes(c, mlp)),
            f"model.layers.{i}.input_layernorm.weight": (c.hidden_size,),
            f"model.layers.{i}.post_attention_layernorm.weight": (c.hidden_size,),
        }
        if c.attention_bias:
            layer.update({f"{attn}.q_proj.bias": (q,), f"{attn}.k_proj.bias": (kv,),
                          f"{attn}.v_proj.bias": (kv,)})  # fmt: skip
        if c.mlp_bias and not c.is_sparse_layer(i):
            layer.update({f"{mlp}.gate_proj.bias": (c.intermediate_size,),
                          f"{mlp}.up_proj.bias": (c.intermediate_size,),
                          f"{mlp}.down_proj.bias": (c.hidden_size,)})  # fmt: skip
        if c.qk_norm:
            layer.update({f"{attn}.q_norm.weight": (c.head_dim,),
                          f"{attn}.k_norm.weight": (c.head_dim,)})  # fmt: skip
        shapes.update(layer)
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def _mlp_shapes(c: ModelConfig, mlp: str) -> dict[str, tuple[int, ...]]:
    return {
        f"{mlp}.gate_proj.weight": (c.intermediate_size, c.hidden_size),
        f"{mlp}.up_proj.weight": (c.intermediate_size, c.hidden_size),
        f"{mlp}.down_proj.weight": (c.hidden_size, c.intermediate_size),
    }


def _moe_shapes(c: ModelConfig, mlp: str) -> dict[str, tuple[int, ...]]:
    h, i = c.hidden_size, c.moe_intermediate_size
    shapes = {f"{mlp}.gate.weight": (c.num_experts, h)}
    for e in range(c.num_experts):
        shapes.update({f"{mlp}.experts.{e}.gate_proj.weight": (i, h),
                       f"{mlp}.experts.{e}.up_proj.weight": (i, h),
                       f"{mlp}.experts.{e}.down_proj.weight": (h, i)})  # fmt: skip
    if c.shared_expert_intermediate_size:
        s = c.shared_expert_intermediate_size
        shapes.update({f"{mlp}.shared_expert.gate_proj.weight": (s, h),
                       f"{mlp}.shared_expert.up_proj.weight": (s, h),
                       f"{mlp}.shared_expert.down_proj.weight": (h, s),
                       f"{mlp}.shared_expert_gate.weight": (1, h)})  # fmt: skip
    return shapes
