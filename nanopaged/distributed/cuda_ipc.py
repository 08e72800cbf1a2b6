"""Device memory that every tensor-parallel process of one host can address (CUDA IPC).

Each rank allocates its block with the CUDA runtime, exports a handle, and opens every peer's
handle, which maps the peer's block into this process (NVLink or PCIe peer access). The
runtime's calls are made through the libcudart that torch itself loaded, so they act on the
same primary context and current device as torch.

Nothing here keeps process-wide state between uses: a later tensor-parallel LLM in the same
process maps fresh blocks with fresh handles.
"""

from __future__ import annotations

import ctypes
import os
from typing import Protocol

import torch

from nanopaged.platform import CUDA

_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _HANDLE_BYTES)]


_runtime: ctypes.CDLL | None = None


def cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library torch has loaded, with the IPC calls typed; None without one
    (a CPU build, or a runtime linked statically)."""
    global _runtime
    if _runtime is not None or not CUDA.is_available():
        return _runtime
    torch.cuda.init()
    path = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            name = line.split()[-1]
            if os.path.basename(name).startswith("libcudart.so"):
                path = name
                break
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    lib.cudaFree.argtypes = [ctypes.c_void_p]
    lib.cudaMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcMemHandle), ctypes.c_void_p]
    lib.cudaIpcOpenMemHandle.argtypes = [
        ctypes.POINTER(ctypes.c_void_p), _IpcMemHandle, ctypes.c_uint
    ]
    lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
    lib.cudaGetLastError.argtypes = []
    lib.cudaGetErrorString.argtypes = [ctypes.c_int]
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    _runtime = lib
    return lib


def _check(lib: ctypes.CDLL, code: int, call: str) -> None:
    if code != 0:
        lib.cudaGetLastError()  # clear it, or torch's next launch check reports it again
        raise RuntimeError(f"{call} failed: {lib.cudaGetErrorString(code).decode()}")


class RankGroup(Protocol):
    """What PeerBuffers asks of its tensor-parallel group (distributed.parallel's
    TensorParallel is one)."""

    rank: int

    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...

    def min_over_ranks(self, value: int) -> int: ...


class PeerMapError(RuntimeError):
    """Some rank could not share or map a block; raised on every rank at the same point."""


class PeerBuffers:
    """nbytes of zeroed device memory on every rank; ptrs[r] is rank r's block, as this
    process addresses it. Collective: every rank constructs it with the same nbytes, and
    when any rank fails, all raise PeerMapError together (so all can go on without it)."""

    def __init__(self, tp: RankGroup, device: torch.device, nbytes: int) -> None:
        lib = cuda_runtime()
        assert lib is not None, "PeerBuffers needs the CUDA runtime (see cuda_runtime)"
        self._lib, self._device = lib, device
        self._own: int | None = None
        self._opened: list[int] = []
        self.ptrs: list[int] = []
        with torch.cuda.device(device):
            handle, error = self._export(nbytes), None
            # Every rank's flag and handle: [size, 1 + 64] bytes.
            mine = torch.frombuffer(bytearray(b"\1" + handle if handle else bytes(65)),
                                    dtype=torch.uint8)  # fmt: skip
            shared = tp.all_gather(mine.to(device)).cpu()
            if int(shared[:, 0].min()) == 1:
                try:
                    self._open(tp.rank, [bytes(row[1:].tolist()) for row in shared])
                except RuntimeError as e:
                    error = e
            else:
                error = RuntimeError("a rank could not export its block")
            if tp.min_over_ranks(int(error is None)) == 0:
                self.close()
                raise PeerMapError(f"peer memory unavailable: {error or 'on another rank'}")

    def _export(self, nbytes: int) -> bytes | None:
        """Allocate and zero this rank's block; its IPC handle, None when that failed."""
        lib = self._lib
        try:
            ptr = ctypes.c_void_p()
            _check(lib, lib.cudaMalloc(ctypes.byref(ptr), nbytes), "cudaMalloc")
            self._own = ptr.value
            _check(lib, lib.cudaMemset(ptr, 0, nbytes), "cudaMemset")
            handle = _IpcMemHandle()
            _check(lib, lib.cudaIpcGetMemHandle(ctypes.byref(handle), ptr), "cudaIpcGetMemHandle")
            torch.cuda.synchronize(self._device)  # zeroed before any peer learns the handle
        except RuntimeError:
            return None
        return bytes(handle)  # not handle.reserved: a char array field stops at its first NUL

    def _open(self, rank: int, handles: list[bytes]) -> None:
        lib = self._lib
        for r, raw in enumerate(handles):
            if r == rank:
                self.ptrs.append(self._own)
                continue
            theirs = _IpcMemHandle()
            ctypes.memmove(ctypes.byref(theirs), raw, _HANDLE_BYTES)
            mapped = ctypes.c_void_p()
            _check(lib, lib.cudaIpcOpenMemHandle(
                ctypes.byref(mapped), theirs, _LAZY_ENABLE_PEER_ACCESS),
                "cudaIpcOpenMemHandle")  # fmt: skip
            self._opened.append(mapped.value)
            self.ptrs.append(mapped.value)

    def close(self) -> None:
        """Unmap the peers' blocks and free this rank's; call once no kernel uses them."""
        with torch.cuda.device(self._device):
            for ptr in self._opened:
                self._lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr))
            self._opened = []
            if self._own is not None:
                self._lib.cudaFree(ctypes.c_void_p(self._own))
                self._own = None
