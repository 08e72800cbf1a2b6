"""Quantized checkpoints written by each format's own rules (round-to-nearest; the packing and
dequantization are what a reader must get right), and tiny models saved in them.

Each quantize_* takes a float weight [out, in] and returns (the checkpoint's tensors for that
layer, keyed by suffix, and the weight they stand for, dequantized in fp32 as [out, in]).
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AWQ_ORDER_MAP = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of an int32 holds column order[i]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, C] ints in [0, 16) -> int32 [R, C / 8] in AutoAWQ's column order."""
    rows, cols = values.shape
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for col in range(cols // 8):
        for i, j in enumerate(AWQ_ORDER_MAP):
            packed[:, col] |= values[:, col * 8 + j].long() << (4 * i)
    return _to_int32(packed)


def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[R, C] ints -> int32 [R / 8, C]: row 8i + j at nibble j of row i (GPTQ qweight)."""
    rows, cols = values.shape
    packed = torch.zeros(rows // 8, cols, dtype=torch.int64)
    for j in range(8):
        packed |= values[j::8].long() << (4 * j)
    return _to_int32(packed)


def _pack_cols(values: torch.Tensor) -> torch.Tensor:
    """[R, C] ints -> int32 [R, C / 8]: column 8i + j at nibble j (GPTQ qzeros)."""
    return _pack_rows(values.t().contiguous()).t().contiguous()


def _to_int32(packed: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words as the int32 a checkpoint stores (two's complement)."""
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _asym(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale fp16, zero) per column of w [rows, cols]: min..max onto 0..15."""
    hi, lo = w.amax(0).clamp(min=0), w.amin(0).clamp(max=0)
    scale = ((hi - lo) / 15).clamp(min=1e-5).half()
    zero = torch.round(-lo / scale.float()).clamp(0, 15)
    return scale, zero


def _quantize_4bit(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(w / scale.float()) + zero, 0, 15)


def quantize_awq(weight: torch.Tensor, group: int) -> tuple[dict, torch.Tensor]:
    """AWQ GEMM: qweight [in, out/8], qzeros [in/group, out/8], scales fp16 [in/group, out]."""
    w = weight.float().t()  # [in, out]
    q = torch.empty_like(w)
    scales, zeros = [], []
    for g in range(w.shape[0] // group):
        rows = slice(g * group, (g + 1) * group)
        scale, zero = _asym(w[rows])
        q[rows] = _quantize_4bit(w[rows], scale, zero)
        scales.append(scale)
        zeros.append(zero)
    scales, zeros = torch.stack(scales), torch.stack(zeros)
    g_of_row = torch.arange(w.shape[0]) // group
    deq = (q - zeros[g_of_row]) * scales[g_of_row].float()
    tensors = dict(qweight=_pack_awq(q.int()), qzeros=_pack_awq(zeros.int()), scales=scales)
    return tensors, deq.t().contiguous()


def quantize_gptq(
    weight: torch.Tensor, group: int, sym: bool, desc_act: bool, v1: bool = True, seed: int = 0
) -> tuple[dict, torch.Tensor]:
    """GPTQ: qweight [in/8, out], qzeros [groups, out/8] (v1: zero - 1), scales fp16
    [groups, out], g_idx [in]. desc_act: rows taken in a random order, each run of `group`
    of them a group (as GPTQ orders them by activation size)."""
    w = weight.float().t()  # [in, out]
    rows = w.shape[0]
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed)) if desc_act \
        else torch.arange(rows)  # fmt: skip
    g_idx = torch.empty(rows, dtype=torch.int32)
    g_idx[order] = (torch.arange(rows) // group).int()
    q = torch.empty_like(w)
    scales, zeros = [], []
    for g in range(rows // group):
        members = order[g * group : (g + 1) * group]
        if sym:
            scale = (2 * w[members].abs().amax(0) / 15).clamp(min=1e-5).half()
            zero = torch.full_like(scale, 8, dtype=torch.float32)
        else:
            scale, zero = _asym(w[members])
            if v1:  # v1 stores zero - 1 in 4 bits: a zero of 0 cannot be written
                zero = zero.clamp(min=1)
        q[members] = _quantize_4bit(w[members], scale, zero)
        scales.append(scale)
        zeros.append(zero)
    scales, zeros = torch.stack(scales), torch.stack(zeros)
    gl = g_idx.long()
    deq = (q - zeros[gl]) * scales[gl].float()
    stored = zeros - 1 if v1 else zeros
    tensors = dict(qweight=_pack_rows(q.int()), qzeros=_pack_cols(stored.int() & 0xF),
                   scales=scales, g_idx=g_idx)  # fmt: skip
    return tensors, deq.t().contiguous()


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int]) -> tuple[dict, torch.Tensor]:
    """Block FP8: weight e4m3 [out, in], weight_scale_inv fp32 [ceil(out/bn), ceil(in/bk)],
    the factor each block's e4m3 values are multiplied by."""
    bn, bk = block
    w = weight.float()
    n, k = w.shape
    scale = torch.empty(-(-n // bn), -(-k // bk))
    q = torch.empty(n, k, dtype=FP8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            s = tile.abs().amax().clamp(min=1e-8) / FP8_MAX
            scale[i, j] = s
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (tile / s).to(FP8)
    rows = torch.arange(n) // bn
    cols = torch.arange(k) // bk
    deq = q.float() * scale[rows][:, cols]
    return dict(weight=q, weight_scale_inv=scale), deq


def quantize_fp8_scaled(weight: torch.Tensor, strategy: str) -> tuple[dict, torch.Tensor]:
    """compressed-tensors FP8: weight e4m3 [out, in], weight_scale [out, 1] ("channel") or
    [1] ("tensor"); weight = e4m3 * weight_scale."""
    w = weight.float()
    if strategy == "channel":
        scale = w.abs().amax(1, keepdim=True).clamp(min=1e-8) / FP8_MAX
    else:
        scale = (w.abs().amax().clamp(min=1e-8) / FP8_MAX).reshape(1)
    q = (w / scale).to(FP8)
    return dict(weight=q, weight_scale=scale), q.float() * scale


# name -> (quantization_config, quantize(weight [out, in], seed) -> (tensors, deq))
def formats(group: int = 32, block: tuple[int, int] = (32, 32)) -> dict:
    fp8_cfg = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                   weight_block_size=list(block))  # fmt: skip

    def ct_cfg(strategy: str) -> dict:
        return dict(
            quant_method="compressed-tensors", format="float-quantized",
            quantization_status="compressed", ignore=["lm_head"],
            config_groups=dict(group_0=dict(
                targets=["Linear"],
                weights=dict(num_bits=8, type="float", strategy=strategy, symmetric=True,
                             dynamic=False),
                input_activations=dict(num_bits=8, type="float", strategy="token",
                                       symmetric=True, dynamic=True),
            )),
        )  # fmt: skip

    def gptq_cfg(sym: bool, desc_act: bool) -> dict:
        return dict(quant_method="gptq", bits=4, group_size=group, sym=sym, desc_act=desc_act,
                    checkpoint_format="gptq")  # fmt: skip

    awq_cfg = dict(quant_method="awq", bits=4, group_size=group, version="gemm", zero_point=True)
    return {
        "fp8-block": (fp8_cfg, lambda w, i: quantize_fp8_block(w, block)),
        "ct-fp8-channel": (ct_cfg("channel"), lambda w, i: quantize_fp8_scaled(w, "channel")),
        "ct-fp8-tensor": (ct_cfg("tensor"), lambda w, i: quantize_fp8_scaled(w, "tensor")),
        "awq": (awq_cfg, lambda w, i: quantize_awq(w, group)),
        "gptq-sym": (gptq_cfg(True, False), lambda w, i: quantize_gptq(w, group, True, False)),
        "gptq-asym-desc_act": (gptq_cfg(False, True),
                               lambda w, i: quantize_gptq(w, group, False, True, seed=i)),
    }  # fmt: skip


def _input_seed(module: str) -> int:
    """One seed per layer input: q, k, v (and gate, up) share their input, so GPTQ's
    activation order, and with it g_idx, is the same for them."""
    for part, shared in (("q_proj", "qkv"), ("k_proj", "qkv"), ("v_proj", "qkv"),
                         ("gate_proj", "gate_up"), ("up_proj", "gate_up")):  # fmt: skip
        module = module.replace(part, shared)
    return zlib.crc32(module.encode())


def write_quantized(src: Path, quant_dir: Path, deq_dir: Path, fmt: tuple) -> None:
    """src's model with every projection quantized: the checkpoint in quant_dir (config.json
    with quantization_config) and the same model with the dequantized weights, in float,
    in deq_dir (what HF transformers runs as the reference)."""
    from safetensors.torch import load_file, save_file

    config, quantize = fmt
    weights = load_file(src / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, tensor in sorted(weights.items()):
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS:
            tensors, deq = quantize(tensor, _input_seed(module))
            quantized.update({f"{module}.{k}": v.contiguous() for k, v in tensors.items()})
            dequantized[name] = deq.to(tensor.dtype)
        else:
            quantized[name] = dequantized[name] = tensor
    for d, tensors in ((quant_dir, quantized), (deq_dir, dequantized)):
        d.mkdir(parents=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, d / f.name)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((quant_dir / "config.json").read_text())
    cfg["quantization_config"] = config
    (quant_dir / "config.json").write_text(json.dumps(cfg))


def write_with_compressed_tensors(
    src: Path, quant_dir: Path, deq_dir: Path, strategy: str, block: tuple[int, int] = (32, 32)
) -> None:
    """src's model as the compressed-tensors library writes an FP8 checkpoint (scales set by
    the min-max rule: largest |w| of each channel, tensor or tile onto 448), and in deq_dir
    the float model that checkpoint stands for."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from safetensors.torch import load_file, save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    weights = dict(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
    if strategy == "block":
        weights["block_structure"] = list(block)
    activations = dict(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
    config = QuantizationConfig.model_validate(dict(
        config_groups=dict(group_0=dict(targets=["Linear"], weights=weights,
                                        input_activations=activations)),
        ignore=["lm_head"], format="float-quantized",
    ))  # fmt: skip
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                module.weight_scale.copy_(_minmax_scale(module.weight, strategy, block))
                module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(quant_dir)
    compressor.update_config(quant_dir)
    # the reference: every e4m3 weight times its scale, in float
    tensors = load_file(quant_dir / "model.safetensors")
    float_weights = load_file(src / "model.safetensors")
    for name, scale in tensors.items():
        if name.endswith(".weight_scale"):
            weight = name.removesuffix("_scale")
            n, k = tensors[weight].shape
            tile = block if strategy == "block" else (n // scale.shape[0], k // scale.shape[-1])
            full = scale.float().reshape(-1, scale.shape[-1] if scale.dim() > 1 else 1)
            full = full.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)
            float_weights[weight] = tensors[weight].float() * full[:n, :k]
    shutil.copytree(src, deq_dir)
    save_file(float_weights, deq_dir / "model.safetensors", metadata={"format": "pt"})


def _minmax_scale(w: torch.Tensor, strategy: str, block: tuple[int, int]) -> torch.Tensor:
    w = w.float().abs()
    if strategy == "channel":
        return w.amax(1, keepdim=True) / FP8_MAX
    if strategy == "tensor":
        return w.amax().reshape(1) / FP8_MAX
    n, k = w.shape
    tiles = w.view(n // block[0], block[0], k // block[1], block[1])
    return tiles.amax((1, 3)) / FP8_MAX
