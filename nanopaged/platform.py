"""What differs between a CUDA device and a CPU, decided in one place.

The rest of the package asks a Platform (platform_of(device)) what it can do, or moves data
with the helpers below, instead of testing device types itself: the attention backend is
chosen in attention/ (by device and dtype), everything else here.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Platform:
    """One kind of device and what the engine does on it."""

    name: str
    # Triton kernels, CUDA graphs, a memory profile sizes the KV cache, page-locked host buffers
    gpu: bool
    # torch.distributed backend of tensor-parallel ranks
    dist_backend: str
    # Default of EngineArgs.async_scheduling: plan step N+1 while the device runs step N
    async_scheduling: bool

    def default_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """The dtype a model runs in when none is asked for: on GPUs the checkpoint's, bf16
        for fp32; on CPUs bf16 where the CPU multiplies bf16 natively, else fp32 (exact; without
        native bf16, bf16 and fp16 matmuls convert to fp32 and run slower than fp32 itself)."""
        if not self.gpu:
            return torch.bfloat16 if cpu_native_bf16() else torch.float32
        return torch.bfloat16 if checkpoint_dtype == torch.float32 else checkpoint_dtype

    def is_available(self) -> bool:
        """Whether this process can run on a device of this kind."""
        return not self.gpu or torch.cuda.is_available()

    def device_count(self) -> int | None:
        """Devices of this kind on the machine, None for the CPU (every rank shares it).
        Asks NVML, not the CUDA runtime: a process that forks workers must not start CUDA."""
        return torch.cuda.device_count() if self.gpu else None

    def rank_device(self, rank: int) -> torch.device:
        """The device tensor-parallel rank `rank` runs on: GPU `rank`, or the CPU."""
        return torch.device("cuda", rank) if self.gpu else torch.device("cpu")

    def bind_rank(self, rank: int, size: int) -> torch.device:
        """Make rank_device(rank) this worker process's device: the current GPU, or the CPU
        with an even share of its cores for each of the `size` ranks."""
        if self.gpu:
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        return self.rank_device(rank)

    def compute_capability(self, device: torch.device) -> tuple[int, int] | None:
        """A GPU's (major, minor) compute capability; None for the CPU."""
        return torch.cuda.get_device_capability(device) if self.gpu else None

    def device_name(self, device: torch.device) -> str:
        return torch.cuda.get_device_name(device) if self.gpu else "the CPU"

    def num_sms(self, device: torch.device) -> int:
        """A GPU's multiprocessor count (grid sizes of persistent kernels); 8 elsewhere (the
        Triton interpreter's tests)."""
        return torch.cuda.get_device_properties(device).multi_processor_count if self.gpu else 8

    def is_capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (never on a CPU)."""
        return self.gpu and torch.cuda.is_current_stream_capturing()

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        """What torch's profiler records on this platform: the host, and the GPU's kernels."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return activities


@functools.cache
def cpu_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively: AMX tiles or AVX-512 BF16 dot products (as
    torch's cpuinfo reports them), with oneDNN there to run its bf16 GEMMs."""
    if not torch.backends.mkldnn.is_available():
        return False
    cpu = torch.cpu
    amx = getattr(cpu, "_is_amx_tile_supported", lambda: False)()
    avx512_bf16 = getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
    return bool(amx or avx512_bf16)


CUDA = Platform(name="cuda", gpu=True, dist_backend="nccl", async_scheduling=True)
CPU = Platform(name="cpu", gpu=False, dist_backend="gloo", async_scheduling=False)


def platform_of(device: torch.device | str) -> Platform:
    """The platform of a device ("cuda", "cuda:1", "cpu" or a torch.device)."""
    return CUDA if torch.device(device).type == "cuda" else CPU


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto": CUDA when available, else the CPU; a device that does not exist is an error."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(
            f"device {device!r} does not exist: this machine has "
            f"{torch.cuda.device_count()} CUDA device(s)"
        )
    return dev


def pinned(t: torch.Tensor) -> torch.Tensor:
    """A host tensor in page-locked memory when CUDA is there: a copy from pageable memory
    would wait for the device to finish its queued work (stalling asynchronous steps)."""
    return t.pin_memory() if torch.cuda.is_available() else t


def to_device(
    a: np.ndarray | torch.Tensor, device: torch.device, pin: bool = False
) -> torch.Tensor:
    """A host array on device, queued without waiting for the device's work (a plain
    torch.tensor(..., device=cuda) would). pin: stage it in page-locked memory first (a large
    or latency-critical copy; small step arrays go from pageable memory, measured cheaper)."""
    t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
    if pin and torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class HostCopy:
    """Device tensors copied to the host asynchronously: result() waits for the copy only."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.event: torch.cuda.Event | None = None
        if tensors and tensors[0].is_cuda:
            self.tensors = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, t in zip(self.tensors, tensors):
                host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.tensors = tensors

    def result(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.tensors


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
