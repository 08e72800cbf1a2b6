"""Tiny random HF models saved to disk, the reference for parity tests (no hub access)."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3")
# Mixture-of-experts families: 8 narrow experts, 2 per token (make_tiny_model's defaults).
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe")
_MOE_DEFAULTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def make_tiny_model(path: Path, family: str, seed: int = 0, **overrides) -> Path:
    """Build a small random model of `family` with transformers and save_pretrained it."""
    import transformers

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        # Wide weights make logits far apart, so fp32 rounding cannot flip a greedy argmax.
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    if family in MOE_FAMILIES:
        common.update(_MOE_DEFAULTS)
    if family == "qwen2_moe":
        common["shared_expert_intermediate_size"] = 48
    common.update(overrides)
    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
    }[family]
    if family in ("qwen3", "qwen3_moe"):
        common.setdefault("head_dim", 32)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**common))
    model.to(torch.float32).eval()
    # HF starts biases at zero; random ones make the parity tests check they are applied.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                torch.nn.init.normal_(param, std=common["initializer_range"])
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt, fp32 on CPU, one at a time."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                # ignore_eos on our side: EOS is an ordinary token, never suppressed or final
                eos_token_id=None,
                pad_token_id=0,
            )
        outs.append(gen[0, len(prompt) :].tolist())
    return outs


def add_byte_tokenizer(path: Path, vocab_size: int = 512) -> None:
    """Save a byte-level tokenizer covering ids [0, vocab_size) beside a tiny model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<eos>"] = len(vocab)
    # Two-byte tokens fill the rest, so every id the model can emit decodes to text.
    pairs = (a + b for a in alphabet[33:] for b in alphabet[33:])
    while len(vocab) < vocab_size:
        vocab.setdefault(next(pairs), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)


def add_chat_template(path: Path, template: str) -> None:
    """Put a chat template into the tokenizer saved beside a tiny model."""
    import json

    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))


AMPLIFY = 1024.0  # a power of two: scaling by it is exact in fp32


def amplified_kv(src: Path, dst: Path, extra: dict | None = None) -> Path:
    """The same function as src's model with K and V AMPLIFY times larger (q_proj and o_proj
    divided by it), so K/V run far past e4m3's 448; extra: tensors to add to the checkpoint."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    weights = load_file(src / "model.safetensors")
    for name in weights:
        if ".k_proj." in name or ".v_proj." in name:
            weights[name] = weights[name] * AMPLIFY
        elif ".q_proj." in name or ".o_proj." in name:
            weights[name] = weights[name] / AMPLIFY
    save_file({**weights, **(extra or {})}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
