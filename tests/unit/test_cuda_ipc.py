"""PeerBuffers' bookkeeping against a stand-in CUDA runtime (CPU): the handle bytes travel
whole, a rank that cannot export makes every rank raise PeerMapError together, and close frees
what was allocated."""

from __future__ import annotations

import contextlib
import ctypes

import pytest
import torch

from nanopaged.distributed import cuda_ipc
from nanopaged.distributed.parallel import TensorParallel


class _FakeRuntime:
    """The runtime calls PeerBuffers makes; cudaMalloc fails when told to."""

    def __init__(self, fail_malloc: bool = False) -> None:
        self.fail_malloc, self.freed, self.exported = fail_malloc, [], None

    def cudaMalloc(self, ptr, nbytes):  # noqa: N802 - the runtime's names
        if self.fail_malloc:
            return 2  # cudaErrorMemoryAllocation
        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_void_p))[0] = 0x7F0000001000
        return 0

    def cudaMemset(self, ptr, value, nbytes):  # noqa: N802
        return 0

    def cudaIpcGetMemHandle(self, handle, ptr):  # noqa: N802
        # NUL bytes up front: a char array field would stop at the first one.
        raw = bytes([0, 0, 7]) + bytes(range(1, 62))
        ctypes.memmove(handle, raw, 64)
        self.exported = raw
        return 0

    def cudaFree(self, ptr):  # noqa: N802
        self.freed.append(ptr.value)
        return 0

    def cudaGetLastError(self):  # noqa: N802
        return 0

    def cudaGetErrorString(self, code):  # noqa: N802
        return b"out of memory"


@pytest.fixture
def runtime(monkeypatch):
    def use(fake):
        monkeypatch.setattr(cuda_ipc, "cuda_runtime", lambda: fake)
        monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
        return fake

    return use


def test_a_block_is_shared_and_freed(runtime, monkeypatch):
    fake = runtime(_FakeRuntime())
    sent = []
    tp = TensorParallel()  # one rank: the gather returns this rank's own row
    real_gather = tp.all_gather
    monkeypatch.setattr(tp, "all_gather", lambda x: sent.append(x) or real_gather(x))
    blocks = cuda_ipc.PeerBuffers(tp, torch.device("cpu"), 1 << 20)
    assert blocks.ptrs == [0x7F0000001000]
    assert bytes(sent[0].tolist()) == b"\1" + fake.exported  # flag, then all 64 bytes
    blocks.close()
    blocks.close()
    assert fake.freed == [0x7F0000001000]  # once


def test_a_rank_that_cannot_export_fails_every_rank_together(runtime):
    fake = runtime(_FakeRuntime(fail_malloc=True))
    with pytest.raises(cuda_ipc.PeerMapError, match="could not export"):
        cuda_ipc.PeerBuffers(TensorParallel(), torch.device("cpu"), 1 << 20)
    assert fake.freed == []  # nothing was allocated
