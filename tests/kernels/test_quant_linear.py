"""Quantized linear layers on the GPU path (Triton under the interpreter without a GPU): each
rank's packed q/k/v, column and row shards of every format load from the checkpoint tensors
and multiply as the dequantized float weight does; the CPU path dequantizes the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_inputs import DEVICE
from quant_formats import formats

from nanopaged.distributed.parallel import TensorParallel
from nanopaged.layers.linear import QKVParallelLinear, RowParallelLinear
from nanopaged.quantization import linear_method, parse_quantization_config, weight_bytes

FORMATS = formats(group=32, block=(32, 32))
HIDDEN, HEAD_DIM, HEADS, KV_HEADS = 128, 32, 4, 2


def quantized_checkpoint(fmt: str, shapes: dict[str, tuple[int, int]], seed: int = 0):
    """{module: (its checkpoint tensors, its dequantized fp32 weight)} for float weights of
    the given [out, in] shapes, quantized by fmt's rules."""
    _, quantize = FORMATS[fmt]
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for module, shape in shapes.items():
        w = torch.randn(shape, generator=gen) / shape[1] ** 0.5
        out[module] = quantize(w, 7)  # one seed: q, k, v share GPTQ's row order
    return out


def fp8_exact(m: int, k: int) -> torch.Tensor:
    """x [m, k] that per-token (or per-32-group) FP8 quantization keeps exactly (e4m3 values,
    +-448 in each group of 32, times a power of two per row), so the FP8 layers' products
    equal the float ones up to fp32 rounding (and the interpreter's fp32 -> fp8 cast, which
    rounds some values wrongly, rounds none)."""
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).mul(100).clamp(-448, 448).to(torch.float8_e4m3fn)
    x = x.float()
    x.view(m, -1, 32)[:, :, 0] = 448.0
    return (x * 2.0 ** torch.arange(-12, -12 + m).float()[:, None]).to(DEVICE)


def build(fmt: str, make_layer, modules: list[str]):
    config = parse_quantization_config(FORMATS[fmt][0], "test", "LlamaForCausalLM")
    with torch.device(DEVICE):
        return make_layer(linear_method(config, modules))


def load(layer, checkpoint: dict, shard_ids: dict) -> None:
    params = dict(layer.named_parameters())
    for module, (tensors, _) in checkpoint.items():
        for suffix, tensor in tensors.items():
            if suffix in params:
                layer.weight_loader(params[suffix], tensor.to(DEVICE), shard_ids[module])


def run(layer, x: torch.Tensor, kernels: bool) -> torch.Tensor:
    if kernels:
        layer.quant_method.prepare_kernels(layer)
    else:
        layer.quant_method.process_weights_after_loading(layer, gpu=False)
        assert layer.quant_method is None and layer.weight.dtype == torch.float32
    return layer(x)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "dequantized"])
def test_qkv_shards(fmt, rank, kernels):
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {"q_proj": (q, HIDDEN), "k_proj": (kv, HIDDEN), "v_proj": (kv, HIDDEN)}
    checkpoint = quantized_checkpoint(fmt, shapes)
    tp = TensorParallel(rank=rank, size=2)
    layer = build(fmt, lambda m: QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, False, tp,
                                                   m), list(shapes))  # fmt: skip
    load(layer, checkpoint, {"q_proj": "q", "k_proj": "k", "v_proj": "v"})
    x = fp8_exact(5, HIDDEN)
    # this rank's q rows, then its k rows, then its v rows
    parts = [checkpoint[m][1].to(DEVICE) for m in shapes]
    local = [p.chunk(2)[rank] for p in parts]
    expected = F.linear(x, torch.cat(local))
    got = run(layer, x, kernels)
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5
    # kept quantized: under a third of the fp32 weight's bytes (4-bit: about an eighth)
    float_bytes = 4 * expected.shape[1] * HIDDEN
    assert (weight_bytes(layer) * 3 < float_bytes) == kernels


@pytest.mark.parametrize("fmt", ["awq", "gptq-asym-desc_act", "fp8-block", "ct-fp8-tensor"])
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "dequantized"])
def test_row_shards_sum_to_the_whole(fmt, kernels):
    checkpoint = quantized_checkpoint(fmt, {"down_proj": (HIDDEN, 256)})
    x = fp8_exact(3, 256)
    partial = []
    for rank in range(2):
        tp = TensorParallel(rank=rank, size=2)
        layer = build(fmt, lambda m, tp=tp: RowParallelLinear(256, HIDDEN, False, tp, False, m),
                      ["down_proj"])  # fmt: skip
        load(layer, checkpoint, {"down_proj": None})
        partial.append(run(layer, x.chunk(2, dim=1)[rank].contiguous(), kernels))
    expected = F.linear(x, checkpoint["down_proj"][1].to(DEVICE))
    got = partial[0] + partial[1]
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5


def test_packed_fp8_blocks_must_tile_each_part():
    """Block scales cannot straddle q and k rows: each packed part is whole blocks."""
    config = parse_quantization_config(dict(quant_method="fp8", weight_block_size=[128, 128]),
                                       "test", "LlamaForCausalLM")  # fmt: skip
    method = linear_method(config, ["q_proj", "k_proj", "v_proj"])
    with pytest.raises(ValueError, match=r"output rows \(64\) is not a multiple of "
                                         r"weight_block_size\[0\] \(128\)"):
        QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, False, quant_method=method)
