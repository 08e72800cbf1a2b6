"""The peer all-reduce kernel against its reference, on two GPUs: exact sums, the same bits on
every rank, CUDA graph replays, and an abort that frees a rank whose peer never comes; and
TensorParallel's choice between it and NCCL (CPU)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from nanopaged.distributed.parallel import (
    PEER_ALL_REDUCE_BYTES,
    PEER_ALL_REDUCE_ENV,
    TensorParallel,
)

SIZES = (1, 5, 4095, 4097, 3 * 5120, 256 * 5120, PEER_ALL_REDUCE_BYTES // 4)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _inputs(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return (torch.randn(numel, generator=g) * 4).to(dtype)


def _rank_main(rank: int, world: int, port: int, failures) -> None:
    import torch.distributed as dist

    from nanopaged.kernels.all_reduce import all_reduce_ref

    try:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world,
                                device_id=device)  # fmt: skip
        tp = TensorParallel(rank, world, dist.group.WORLD)
        assert tp.enable_peer_all_reduce(device)
        seed = 0
        for dtype in DTYPES:
            for numel in SIZES:
                if numel * dtype.itemsize > PEER_ALL_REDUCE_BYTES:
                    continue
                seed += 1
                x = _inputs(rank, numel, dtype, seed).to(device)
                want = all_reduce_ref([_inputs(r, numel, dtype, seed) for r in range(world)])
                assert tp.peer.fits(x)
                for push in (False, True):  # both ways of moving the parts
                    y = x.clone()
                    tp.peer.all_reduce(y, push=push)
                    assert torch.equal(y.cpu(), want), (dtype, numel, push)
                tp.all_reduce(x)
                got = x.cpu()
                assert torch.equal(got, want), (dtype, numel)
                # Every rank holds the same bits as rank 0 (a broadcast copies them as is).
                theirs = got.to(device)
                dist.broadcast(theirs, src=0)
                assert torch.equal(theirs.cpu().view(torch.int16 if dtype.itemsize == 2 else
                                                     torch.int32),
                                   got.view(torch.int16 if dtype.itemsize == 2 else
                                            torch.int32)), (dtype, numel)  # fmt: skip
        # CUDA graphs: three sums captured, replayed with fresh inputs each time.
        xs = [torch.empty(4096 * 3, dtype=torch.bfloat16, device=device) for _ in range(3)]
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            for x in xs:
                tp.all_reduce(x)
        torch.cuda.current_stream().wait_stream(stream)
        for replay in range(5):
            wants = []
            for i, x in enumerate(xs):
                s = 100 + 10 * replay + i
                x.copy_(_inputs(rank, x.numel(), x.dtype, s))
                wants.append(all_reduce_ref([_inputs(r, x.numel(), x.dtype, s)
                                             for r in range(world)]))  # fmt: skip
            graph.replay()
            for x, want in zip(xs, wants):
                assert torch.equal(x.cpu(), want), replay
        _check_all_reduce_rms_norm(tp, rank, world, device)
        # Rank 1 never joins this sum: rank 0's kernel waits until its abort word is set.
        dist.barrier()
        if rank == 0:
            x = torch.ones(1000, device=device)
            tp.all_reduce(x)
            done = torch.cuda.Event()
            done.record()
            time.sleep(1.0)
            assert not done.query()  # still waiting for the peer
            t0 = time.monotonic()
            tp.abort()
            done.synchronize()
            assert time.monotonic() - t0 < 5.0
        tp.release()
        dist.destroy_process_group()
        # A second set-up in the same processes, as for a second LLM.
        store = dist.TCPStore("127.0.0.1", port + 1, world, is_master=rank == 0)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world,
                                device_id=device)  # fmt: skip
        tp = TensorParallel(rank, world, dist.group.WORLD)
        assert tp.enable_peer_all_reduce(device)
        x = _inputs(rank, 5120, torch.bfloat16, 7).to(device)
        tp.all_reduce(x)
        assert torch.equal(x.cpu(), all_reduce_ref([_inputs(r, 5120, torch.bfloat16, 7)
                                                    for r in range(world)]))  # fmt: skip
        tp.release()
        dist.destroy_process_group()
    except BaseException as e:
        failures.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


# (rows, hidden): one row to a 16 MiB bf16 slot's worth, hidden sizes with and without
# a power of two or a multiple of 16.
NORM_SHAPES = ((1, 5120), (3, 896), (256, 5120), (129, 100), (1638, 5120), (7, 8192))


def _check_all_reduce_rms_norm(tp, rank, world, device) -> None:
    """The fused sum + residual + RMSNorm equals the all-reduce followed by the rms_norm
    kernel bit for bit, and the reference (the sum + residual exactly), eagerly and from a
    CUDA graph; x is left as it was."""
    from nanopaged.kernels.all_reduce import all_reduce_ref, all_reduce_rms_norm_ref
    from nanopaged.kernels.rms_norm import rms_norm

    seed = 500
    for dtype in DTYPES:
        for rows, hidden in NORM_SHAPES:
            if rows * hidden * dtype.itemsize > PEER_ALL_REDUCE_BYTES:
                continue
            seed += 1
            parts = [_inputs(r, rows * hidden, dtype, seed).view(rows, hidden)
                     for r in range(world)]  # fmt: skip
            residual = _inputs(world, rows * hidden, dtype, seed).view(rows, hidden)
            weight = _inputs(world + 1, hidden, dtype, seed)
            args = (residual.to(device), weight.to(device), 1e-6)
            x = parts[rank].to(device)
            assert tp.peer.fits_rows(x, args[0])
            for push in (False, True):
                out, new_residual = tp.peer.all_reduce_rms_norm(x, *args, push=push)
                assert torch.equal(x.cpu(), parts[rank])  # the part is not summed in place
                summed = x.clone()
                tp.peer.all_reduce(summed)
                want_out, want_residual = rms_norm(summed, args[1], args[2], args[0])
                assert torch.equal(new_residual, want_residual), (dtype, rows, hidden, push)
                assert torch.equal(out, want_out), (dtype, rows, hidden, push)
            ref_out, ref_residual = all_reduce_rms_norm_ref(parts, residual, weight, 1e-6)
            assert torch.equal(new_residual.cpu(), ref_residual), (dtype, rows, hidden)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.cpu(), ref_out, atol=tol, rtol=tol)
    # Captured between two plain sums and replayed with fresh inputs, as a decode step runs.
    x = torch.empty(8, 5120, dtype=torch.bfloat16, device=device)
    y, z = torch.empty_like(x), torch.empty_like(x)
    residual, weight = torch.empty_like(x), torch.empty(5120, dtype=x.dtype, device=device)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        tp.all_reduce(y)
        out, new_residual = tp.all_reduce_rms_norm(x, residual, weight, 1e-6, rms_norm)
        tp.all_reduce(z)
    torch.cuda.current_stream().wait_stream(stream)
    for replay in range(3):
        s = 900 + 4 * replay
        parts = [[_inputs(r, x.numel(), x.dtype, s + i).view(x.shape) for r in range(world)]
                 for i in range(3)]  # fmt: skip
        for t, p in zip((x, y, z), parts):
            t.copy_(p[rank])
        residual.copy_(_inputs(world, x.numel(), x.dtype, s + 3).view(x.shape))
        weight.copy_(_inputs(world + 1, 5120, x.dtype, s + 3))
        graph.replay()
        ref_out, ref_residual = all_reduce_rms_norm_ref(parts[0], residual.cpu(), weight.cpu(),
                                                        1e-6)  # fmt: skip
        assert torch.equal(new_residual.cpu(), ref_residual), replay
        torch.testing.assert_close(out.cpu(), ref_out, atol=2e-2, rtol=2e-2)
        assert torch.equal(y.cpu(), all_reduce_ref(parts[1])), replay
        assert torch.equal(z.cpu(), all_reduce_ref(parts[2])), replay


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 CUDA devices")
def test_peer_all_reduce_two_gpus(monkeypatch):
    monkeypatch.delenv(PEER_ALL_REDUCE_ENV, raising=False)  # on unless switched off
    ctx = mp.get_context("spawn")
    failures = ctx.SimpleQueue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, failures)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    errors = []
    while not failures.empty():
        errors.append(failures.get())
    assert not alive, "a rank hung"
    assert errors == [] and all(p.exitcode == 0 for p in procs), errors


class _Peer:
    """Stands in for PeerAllReduce: records the tensors it sums."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.seen, self.aborted = max_bytes, [], False

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.max_bytes

    def all_reduce(self, x: torch.Tensor) -> None:
        self.seen.append(x)

    def abort(self) -> None:
        self.aborted = True


def test_small_sums_go_to_the_peer_path_large_ones_to_the_group(monkeypatch):
    import torch.distributed as dist

    nccl = []
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None: nccl.append(x))
    tp = TensorParallel(0, 2, None)
    tp.peer = _Peer(max_bytes=1024)
    small, large = torch.zeros(256), torch.zeros(257)
    assert tp.all_reduce(small) is small and tp.all_reduce(large) is large
    assert tp.peer.seen == [small] and nccl == [large]
    tp.abort()
    assert tp.peer.aborted
    one = TensorParallel()
    one.peer = _Peer(max_bytes=1024)
    one.all_reduce(small)
    assert one.peer.seen == []  # a single rank sums nothing


def test_no_peer_path_on_cpu_one_rank_or_when_switched_off(monkeypatch):
    monkeypatch.delenv(PEER_ALL_REDUCE_ENV, raising=False)
    assert not TensorParallel().enable_peer_all_reduce(torch.device("cpu"))
    assert not TensorParallel(0, 2, None).enable_peer_all_reduce(torch.device("cpu"))
    monkeypatch.setenv(PEER_ALL_REDUCE_ENV, "0")
    # Switched off: returns before any collective (group None would fail one).
    assert not TensorParallel(0, 2, None).enable_peer_all_reduce(torch.device("cuda"))
