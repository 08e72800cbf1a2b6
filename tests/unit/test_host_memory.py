"""The CPU path's malloc tuning: applied once on glibc, skipped when the user opts out."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import sys

import pytest

from nanopaged.engine import host_memory

REAL_CDLL = ctypes.CDLL
GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", None)
    return host_memory


class SpyLibc:
    """The real C library, with every mallopt call recorded."""

    def __init__(self, name):
        self._libc = REAL_CDLL(name)
        self.calls = []
        spy = self

        class Mallopt:
            argtypes = restype = None

            def __call__(self, param, value):
                spy.calls.append((param, value))
                return spy._libc.mallopt(param, value)

        self.mallopt = Mallopt()

    def __getattr__(self, attr):
        return getattr(self._libc, attr)


@pytest.mark.skipif(not GLIBC or ctypes.util.find_library("c") is None, reason="needs glibc")
def test_applied_once_on_glibc(fresh, monkeypatch):
    monkeypatch.delenv("NANOPAGED_MALLOC_TUNING", raising=False)
    opened = []
    monkeypatch.setattr(
        host_memory.ctypes, "CDLL", lambda name: opened.append(SpyLibc(name)) or opened[-1]
    )
    assert fresh.keep_freed_memory() is True
    assert len(opened) == 1
    assert sorted(opened[0].calls) == sorted([
        (host_memory.M_MMAP_THRESHOLD, host_memory.MMAP_THRESHOLD),
        (host_memory.M_TRIM_THRESHOLD, host_memory.TRIM_THRESHOLD),
    ])  # fmt: skip
    # A second call does not open the library or call mallopt again: its answer is remembered.
    assert fresh.keep_freed_memory() is True
    assert len(opened) == 1 and len(opened[0].calls) == 2


def test_opt_out_leaves_malloc_alone(fresh, monkeypatch):
    monkeypatch.setenv("NANOPAGED_MALLOC_TUNING", "0")
    calls = []
    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda *a: calls.append(a))
    assert fresh.keep_freed_memory() is False
    assert calls == []


def test_cpu_runner_applies_it(tmp_path, monkeypatch):
    from tiny_models import make_tiny_model

    from nanopaged import LLM

    calls = []
    monkeypatch.setattr(
        "nanopaged.engine.model_runner.keep_freed_memory", lambda: calls.append(1) or True
    )
    LLM(str(make_tiny_model(tmp_path / "m", "llama")), device="cpu", kv_cache_memory=1 << 20,
        max_model_len=32)  # fmt: skip
    assert calls == [1]
