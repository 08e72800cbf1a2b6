"""`nanopaged run-batch`: OpenAI batch-format requests in, one result line per request out.

Input lines are {"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}} (the format of OpenAI's Batch API and `vllm run-batch`).
Results are appended to the output file; custom_ids already there are skipped, so an
interrupted run picks up where it stopped.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from nanopaged.config import KV_CACHE_DTYPES
from nanopaged.llm import LLM
from nanopaged.outputs import CompletionOutput, RequestOutput
from nanopaged.sampling_params import SamplingParams

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
# Requests handed to the engine at once; results are written after each chunk.
CHUNK = 256


class BadRequest(ValueError):
    """A request line that cannot be served; becomes a status-400 record."""


@dataclass
class BatchRequest:
    """One parsed input line."""

    custom_id: str
    url: str
    body: dict
    params: SamplingParams = field(default_factory=SamplingParams)


# ---- parsing -------------------------------------------------------------------------------
def _number(body: dict, name: str, default):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"body.{name} must be a number, got {type(value).__name__}")
    return value


def _int(body: dict, name: str, default):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"body.{name} must be an integer, got {type(value).__name__}")
    return value


def sampling_params_from_body(body: dict, url: str, defaults: SamplingParams) -> SamplingParams:
    """The SamplingParams an OpenAI request body asks for, over the model's defaults."""
    if url == CHAT_URL:
        # max_completion_tokens is the newer name; None: up to max_model_len, as vLLM serves.
        max_tokens = _int(body, "max_completion_tokens", None)
        max_tokens = _int(body, "max_tokens", max_tokens)
        top_logprobs = _int(body, "top_logprobs", 0)
        want = body.get("logprobs", False)
        if not isinstance(want, bool):
            raise BadRequest(f"body.logprobs must be a bool for chat, got {want!r}")
        logprobs = top_logprobs if want else None
    else:
        max_tokens = _int(body, "max_tokens", 16)  # the OpenAI completions default
        logprobs = _int(body, "logprobs", None)
    stop = body.get("stop")
    logit_bias = body.get("logit_bias")
    if logit_bias is not None:
        if not isinstance(logit_bias, dict):
            raise BadRequest("body.logit_bias must be an object of token id -> bias")
        try:
            # JSON object keys are strings; OpenAI's are token ids written as text.
            logit_bias = {int(k): v for k, v in logit_bias.items()}
        except ValueError as e:
            raise BadRequest(f"body.logit_bias keys must be token ids: {e}") from None
    try:
        return SamplingParams(
            n=_int(body, "n", 1),
            temperature=_number(body, "temperature", defaults.temperature),
            top_p=_number(body, "top_p", defaults.top_p),
            top_k=_int(body, "top_k", defaults.top_k),
            min_p=_number(body, "min_p", defaults.min_p),
            repetition_penalty=_number(body, "repetition_penalty", defaults.repetition_penalty),
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            seed=_int(body, "seed", None),
            max_tokens=max_tokens,
            stop=stop,
            logprobs=logprobs,
            logit_bias=logit_bias,
        )
    except (ValueError, TypeError) as e:
        raise BadRequest(f"body: {e}") from None


def parse_line(line: str, defaults: SamplingParams) -> BatchRequest:
    """One input line as a BatchRequest; BadRequest names what is wrong."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadRequest(f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"a request line must be a JSON object, got {type(obj).__name__}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BadRequest("custom_id must be a non-empty string")
    if obj.get("method", "POST") != "POST":
        raise BadRequest(f"method must be 'POST', got {obj.get('method')!r}")
    url = obj.get("url")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise BadRequest(f"url must be {CHAT_URL!r} or {COMPLETIONS_URL!r}, got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    if url == CHAT_URL:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("body.messages must be a non-empty list of messages")
    else:
        prompt = body.get("prompt")
        ok = isinstance(prompt, str) or (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        )
        if not ok:
            raise BadRequest("body.prompt must be a string or a list of token ids")
    return BatchRequest(custom_id, url, body, sampling_params_from_body(body, url, defaults))


def _custom_id_of(line: str) -> str | None:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) else None


def done_custom_ids(output_path: Path) -> set[str]:
    """custom_ids that already have a result line in output_path."""
    if not output_path.exists():
        return set()
    with output_path.open() as f:
        return {cid for cid in map(_custom_id_of, f) if cid is not None}


# ---- results -------------------------------------------------------------------------------
def _token_text(llm: LLM, token: int) -> str:
    return llm.tokenizer.decode([token]) if llm.tokenizer is not None else str(token)


def _chat_logprobs(llm: LLM, c: CompletionOutput) -> dict | None:
    if c.logprobs is None:
        return None
    content = []
    for token, entry in zip(c.token_ids, c.logprobs):
        text = _token_text(llm, token)
        content.append(
            {
                "token": text,
                "logprob": entry[token].logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": _token_text(llm, t), "logprob": lp.logprob,
                     "bytes": list(_token_text(llm, t).encode())}
                    for t, lp in sorted(entry.items(), key=lambda kv: -kv[1].logprob)
                ],
            }
        )  # fmt: skip
    return {"content": content}


def _completion_logprobs(llm: LLM, c: CompletionOutput) -> dict | None:
    if c.logprobs is None:
        return None
    tokens = [_token_text(llm, t) for t in c.token_ids]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e[t].logprob for t, e in zip(c.token_ids, c.logprobs)],
        "top_logprobs": [
            {_token_text(llm, t): lp.logprob for t, lp in e.items()} for e in c.logprobs
        ],
        "text_offset": offsets,
    }


def response_body(llm: LLM, req: BatchRequest, out: RequestOutput, model_name: str) -> dict:
    """The chat.completion or text_completion object OpenAI's API returns for req."""
    chat = req.url == CHAT_URL
    choices = []
    for c in out.outputs:
        choice: dict = {"index": c.index}
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
            choice["logprobs"] = _chat_logprobs(llm, c)
        else:
            choice["text"] = c.text
            choice["logprobs"] = _completion_logprobs(llm, c)
        choice["finish_reason"] = c.finish_reason
        choice["stop_reason"] = c.stop_reason
        choices.append(choice)
    prompt_tokens = len(out.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _record(custom_id: str | None, status: int, body: dict | None, error: str | None) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": body},
        "error": None if error is None else {"code": "invalid_request", "message": error},
    }


# ---- running -------------------------------------------------------------------------------
def _serve(llm: LLM, reqs: list[BatchRequest]) -> list[RequestOutput]:
    """Run reqs of one url together (validation comes before any work, so a refusal is cheap)."""
    params = [r.params for r in reqs]
    if reqs[0].url == CHAT_URL:
        return llm.chat([r.body["messages"] for r in reqs], params, use_tqdm=False)
    return llm.generate([r.body["prompt"] for r in reqs], params, use_tqdm=False)


def _serve_chunk(llm: LLM, reqs: list[BatchRequest], model_name: str) -> list[dict]:
    records: dict[int, dict] = {}
    for url in (CHAT_URL, COMPLETIONS_URL):
        idx = [i for i, r in enumerate(reqs) if r.url == url]
        if not idx:
            continue
        try:
            outs = _serve(llm, [reqs[i] for i in idx])
        except (ValueError, TypeError):
            # One request refused the batch: serve one at a time to find which.
            outs = []
            for i in idx:
                try:
                    outs.append(_serve(llm, [reqs[i]])[0])
                except (ValueError, TypeError) as e:
                    outs.append(e)
        for i, out in zip(idx, outs):
            cid = reqs[i].custom_id
            if isinstance(out, Exception):
                records[i] = _record(cid, 400, None, str(out))
            else:
                records[i] = _record(cid, 200, response_body(llm, reqs[i], out, model_name), None)
    return [records[i] for i in range(len(reqs))]


def run_batch(
    llm: LLM, input_path: Path, output_path: Path, model_name: str, use_tqdm: bool = True
) -> dict[str, int]:
    """Serve every request of input_path not yet in output_path; returns counts by outcome."""
    done = done_custom_ids(output_path)
    defaults = llm.get_default_sampling_params()
    pending: list[BatchRequest | dict] = []
    skipped = 0
    with input_path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            cid = _custom_id_of(line)
            if cid is not None and cid in done:
                skipped += 1
                continue
            try:
                req = parse_line(line, defaults)
            except BadRequest as e:
                pending.append(_record(cid, 400, None, f"line {lineno}: {e}"))
                continue
            done.add(req.custom_id)  # a repeated custom_id is served once
            pending.append(req)
    counts = {"ok": 0, "error": 0, "skipped": skipped}
    output_path.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(pending), desc="Requests", disable=not use_tqdm)
    with output_path.open("a") as out:
        for start in range(0, len(pending), CHUNK):
            chunk = pending[start : start + CHUNK]
            reqs = [r for r in chunk if isinstance(r, BatchRequest)]
            served = iter(_serve_chunk(llm, reqs, model_name) if reqs else [])
            for item in chunk:
                record = next(served) if isinstance(item, BatchRequest) else item
                counts["ok" if record["error"] is None else "error"] += 1
                out.write(json.dumps(record) + "\n")
            out.flush()
            bar.update(len(chunk))
    bar.close()
    return counts


def add_parser(sub) -> None:
    """Register `run-batch` on the `nanopaged` command's subparsers."""
    p = sub.add_parser(
        "run-batch",
        help="serve an OpenAI batch file (.jsonl) offline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-i", "--input-file", required=True, type=Path, help="requests (.jsonl)")
    p.add_argument("-o", "--output-file", required=True, type=Path, help="results (.jsonl)")
    p.add_argument("--model", default=None, help="model dir or .gguf (default: embedded SmolLM2)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="fp8 (= fp8_e4m3) or fp8_e5m2: K/V in 8 bits")  # fmt: skip
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="8-bit KV scales from the first forward pass (else the checkpoint's, "
                        "else 1.0)")  # fmt: skip
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generation-config", default="auto")
    p.add_argument("--disable-progress-bar", action="store_true")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run `nanopaged run-batch` with parsed args."""
    if not args.input_file.is_file():
        raise SystemExit(f"input file {str(args.input_file)!r} does not exist")
    llm = LLM(
        args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
        generation_config=args.generation_config,
    )
    name = args.model if args.model is not None else "SmolLM2-135M-Instruct"
    counts = run_batch(
        llm, args.input_file, args.output_file, str(name), use_tqdm=not args.disable_progress_bar
    )
    print(
        f"run-batch: {counts['ok']} served, {counts['error']} errors, "
        f"{counts['skipped']} already in {args.output_file}"
    )
    return 0
