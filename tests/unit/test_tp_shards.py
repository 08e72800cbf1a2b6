"""Each rank's shard of the tensor-parallel layers, and the step message, without processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanopaged.distributed.parallel import TensorParallel, check_tp_shapes
from nanopaged.engine.step_inputs import StepInputs
from nanopaged.layers.embedding import VocabEmbedding
from nanopaged.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

HIDDEN, HEAD_DIM, NUM_HEADS = 16, 4, 8


def _ranks(size: int) -> list[TensorParallel]:
    return [TensorParallel(rank=r, size=size) for r in range(size)]


@pytest.mark.parametrize("size, num_kv_heads", [(2, 2), (4, 2), (8, 2), (2, 1), (4, 4)])
def test_qkv_shards_hold_their_heads(size, num_kv_heads):
    q = torch.randn(NUM_HEADS * HEAD_DIM, HIDDEN)
    k = torch.randn(num_kv_heads * HEAD_DIM, HIDDEN)
    v = torch.randn(num_kv_heads * HEAD_DIM, HIDDEN)
    group = NUM_HEADS // num_kv_heads  # query heads per KV head
    for tp in _ranks(size):
        layer = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, num_kv_heads, False, tp)
        for shard_id, w in (("q", q), ("k", k), ("v", v)):
            layer.weight_loader(layer.weight, w, shard_id)
        w = layer.weight.view(-1, HEAD_DIM, HIDDEN)  # one row block per head
        heads_q = NUM_HEADS // size
        first_q = tp.rank * heads_q
        assert torch.equal(w[:heads_q], q.view(-1, HEAD_DIM, HIDDEN)[first_q : first_q + heads_q])
        # The KV heads here are exactly the ones this rank's query heads use.
        kv_heads = sorted({h // group for h in range(first_q, first_q + heads_q)})
        n = layer.num_kv_heads
        assert n == len(kv_heads)
        assert torch.equal(w[heads_q : heads_q + n], k.view(-1, HEAD_DIM, HIDDEN)[kv_heads])
        assert torch.equal(w[heads_q + n :], v.view(-1, HEAD_DIM, HIDDEN)[kv_heads])


def test_column_and_row_shards_compose_to_the_full_mlp():
    size, inter = 4, 32
    gate, up = torch.randn(inter, HIDDEN), torch.randn(inter, HIDDEN)
    down = torch.randn(HIDDEN, inter)
    x = torch.randn(3, HIDDEN)
    want = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    total = torch.zeros(3, HIDDEN)
    for tp in _ranks(size):
        gate_up = MergedColumnParallelLinear(HIDDEN, [inter, inter], [0, 1], tp=tp)
        gate_up.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight_loader(gate_up.weight, up, 1)
        row = RowParallelLinear(inter, HIDDEN, tp=tp)
        row.weight_loader(row.weight, down)
        g, u = gate_up(x).chunk(2, dim=-1)
        total += torch.nn.functional.linear(torch.nn.functional.silu(g) * u, row.weight)
    torch.testing.assert_close(total, want)


def test_vocab_shards_pad_an_odd_vocabulary():
    vocab = 11
    full = torch.randn(vocab, HIDDEN)
    rows = []
    for tp in _ranks(2):
        emb = VocabEmbedding(vocab, HIDDEN, tp)
        emb.weight_loader(emb.weight, full)
        rows.append(emb.weight.data)
    assert rows[0].shape == rows[1].shape == (6, HIDDEN)
    assert torch.equal(torch.cat(rows)[:vocab], full)
    assert torch.all(rows[1][-1] == 0)


def test_unsplittable_shapes():
    check_tp_shapes(64, 8, 25600, 8)
    check_tp_shapes(8, 2, 64, 4)  # two ranks share each KV head
    bad = [((8, 2, 64, 3), "num_attention_heads"), ((8, 6, 64, 4), "num_key_value_heads"),
           ((8, 3, 64, 6), "num_attention_heads"), ((8, 2, 30, 4), "intermediate")]  # fmt: skip
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            check_tp_shapes(*args)


@pytest.mark.parametrize("sharded", [False, True])
def test_step_inputs_survive_packing(sharded):
    rng = np.random.default_rng(0)
    settings = np.stack([np.array([0.7, 0.0], np.float32).view(np.int32).astype(np.int64),
                         np.array([-5, 2**40]), np.array([0, 17])])  # fmt: skip
    step = StepInputs(
        input_ids=rng.integers(0, 500, 7),
        positions=np.arange(7),
        slots=rng.integers(0, 100, 7),
        tables=rng.integers(0, 50, (3, 4)).astype(np.int32),
        context_lens=np.array([3, 2, 9], dtype=np.int32),
        cu_seqlens_q=np.array([0, 3, 5, 7], dtype=np.int32),
        logits_indices=np.array([2, 6]),
        blocks_to_swap_out=[(1, 2)],
        blocks_to_swap_in=[],
        blocks_to_copy=[(3, 4), (5, 6)],
        pending_dst=np.array([4]),
        pending_src=np.array([1]),
    )
    if sharded:
        step.sample_settings = settings
    assert step.samples_sharded == sharded
    back = StepInputs.unpack(step.pack())
    for name, value in vars(step).items():
        got = getattr(back, name)
        if isinstance(value, np.ndarray):
            assert got.dtype == value.dtype and np.array_equal(got, value), name
        else:
            assert got == value, name
