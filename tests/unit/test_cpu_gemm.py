"""layers/cpu_gemm: which weights are packed, which row counts take the packed copy, and that
its result is F.linear's within fp32 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanopaged.layers import cpu_gemm

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


@needs_onednn
def test_fp32_weights_pack_and_the_rows_that_use_them(monkeypatch):
    small, head = torch.randn(96, 64), torch.randn(8, 4 << 20)  # 128 MB: an LM head's size
    assert cpu_gemm.can_pack(small) and not cpu_gemm.can_pack(torch.randn(4))
    assert not cpu_gemm.can_pack(small.half())
    assert [cpu_gemm._takes_packed(r, small) for r in (1, 2, 16, 32, 33)] == [
        False, True, True, True, False,
    ]  # fmt: skip
    assert cpu_gemm._takes_packed(1, head)
    monkeypatch.setattr(cpu_gemm, "onednn_bf16", lambda: False)
    assert not cpu_gemm.can_pack(small.bfloat16())  # bf16 only where oneDNN runs it


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_packed_fp32_linear_matches_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(200, 72, generator=gen), torch.randn(200, generator=gen)
    x = torch.randn(rows, 72, generator=gen)
    packed = cpu_gemm.pack_weight(weight)
    out = cpu_gemm.linear(x, weight, bias, packed)
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    forced = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    torch.testing.assert_close(forced, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
