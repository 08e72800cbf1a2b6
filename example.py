"""Chat with a model: `python example.py` uses the embedded SmolLM2-135M-Instruct."""

from __future__ import annotations

import argparse

from nanopaged import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the sea.",
    "Explain in two sentences what a GPU is.",
]


def main(argv: list[str] | None = None) -> list[tuple[str, str]]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF model directory or .gguf file")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)

    llm = LLM(args.model)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = llm.chat(conversations, params)
    answers = []
    for question, out in zip(QUESTIONS, outputs):
        answer = out.outputs[0].text.strip()
        answers.append((question, answer))
        print(f"Q: {question}\nA: {answer}\n")
    return answers


if __name__ == "__main__":
    main()
