"""`nanopaged run-batch`: OpenAI batch-format requests in, one result record per line out.

Input lines are {"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}} (the format of OpenAI's Batch API and `vllm run-batch`).
A body's "response_format" ({"type": "json_schema", "json_schema": {"name", "schema"}},
{"type": "json_object"} or {"type": "text"}) or "structured_outputs" (vLLM's: one of "json",
"regex", "choice", "grammar", "json_object") constrains its output (the `structured` extra).

Every input line gets a record: the response (status 200), or an error (status 400) when the
line is not UTF-8 or JSON, a field is wrong, the model refuses the request (too long, too many
logprobs), its chat template raises, or its custom_id repeats an earlier line's. The valid
requests are served together, continuously batched over the whole file; each record is
appended as its request finishes (so records come in finish order: match them by custom_id),
flushed at once and fsynced at intervals.

Resume: rerun the same command. custom_ids that have a status-200 record in the output are
done and skipped; everything else is served again, error records included (fix the input or
the options, and rerun), the new record appended after the old one: a reader keeps the LAST
record of each custom_id. A torn last line (a kill mid-write, a full disk) is cut off before
anything is appended.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from nanopaged.config import KV_CACHE_DTYPES
from nanopaged.engine.processor import text_parts_joined
from nanopaged.inputs import TokensPrompt, check_unicode
from nanopaged.llm import LLM
from nanopaged.outputs import CompletionOutput, RequestOutput
from nanopaged.sampling_params import SamplingParams, StructuredOutputsParams

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
# A kill loses nothing flushed; a power cut loses at most the records of the last interval.
FSYNC_EVERY = 64  # records
FSYNC_SECONDS = 5.0


class BadRequest(ValueError):
    """A request line that cannot be served; becomes a status-400 record."""


@dataclass
class BatchRequest:
    """One parsed input line."""

    custom_id: str
    url: str
    body: dict
    params: SamplingParams


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


def _response_format(fmt: object) -> StructuredOutputsParams | None:
    if not isinstance(fmt, dict):
        raise BadRequest(f"body.response_format must be an object, got {type(fmt).__name__}")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise BadRequest(
            "body.response_format.type must be 'text', 'json_object' or 'json_schema', "
            f"got {kind!r}"
        )
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise BadRequest(
            'body.response_format must be {"type": "json_schema", "json_schema": {"name": ..., '
            '"schema": {...}}} with the schema an object'
        )
    return StructuredOutputsParams(json=schema)


def structured_outputs_from_body(body: dict) -> StructuredOutputsParams | None:
    """The output constraint a body asks for (response_format or vLLM's structured_outputs),
    its schema, regex or grammar checked (nanopaged.structured.validate); None: none."""
    fmt, extra = body.get("response_format"), body.get("structured_outputs")
    try:
        spec = None if fmt is None else _response_format(fmt)
        if extra is not None:
            if not isinstance(extra, dict):
                raise BadRequest("body.structured_outputs must be an object")
            if spec is not None:
                raise BadRequest("body has both a JSON response_format and structured_outputs")
            unknown = sorted(set(extra) - {"json", "regex", "choice", "grammar", "json_object"})
            if unknown:
                raise BadRequest(
                    f"body.structured_outputs takes json, regex, choice, grammar or "
                    f"json_object, got {', '.join(map(repr, unknown))}"
                )
            spec = StructuredOutputsParams(**extra)
    except (ValueError, TypeError) as e:  # StructuredOutputsParams' checks, unknown fields
        raise BadRequest(f"body: {e}") from None
    if spec is None:
        return None
    try:
        from nanopaged.structured import validate  # only a constrained request needs llguidance

        validate(spec)
    except (ValueError, ImportError) as e:
        raise BadRequest(f"body: {e}") from None
    return spec


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
    structured_outputs = structured_outputs_from_body(body)
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
            structured_outputs=structured_outputs,
        )
    except (ValueError, TypeError) as e:
        raise BadRequest(f"body: {e}") from None


def decode_line(raw: bytes) -> object:
    """One input line as JSON; BadRequest names what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"not valid UTF-8: byte {raw[e.start]:#04x} at offset {e.start}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(f"not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("not valid JSON here: nested too deeply") from None


def custom_id_of(obj: object) -> str | None:
    """The custom_id a decoded line names, if it names one."""
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) and cid else None


def parse_request(obj: object, defaults: SamplingParams) -> BatchRequest:
    """A decoded input line as a BatchRequest; BadRequest names what is wrong."""
    if not isinstance(obj, dict):
        raise BadRequest(f"a request line must be a JSON object, got {type(obj).__name__}")
    custom_id = custom_id_of(obj)
    if custom_id is None:
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
    params = sampling_params_from_body(body, url, defaults)
    return BatchRequest(custom_id, url, body, params)


def scan_output(output_path: Path) -> tuple[set[str], int]:
    """The custom_ids done in output_path (those with a status-200 record), and the length in
    bytes of its whole lines (a torn last line, if any, lies past it)."""
    done: set[str] = set()
    complete = 0
    if not output_path.exists():
        return done, complete
    with output_path.open("rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break  # torn: the write of this record never finished
            complete += len(raw)
            try:
                record = json.loads(raw)
            except (ValueError, RecursionError):
                continue  # never done: not a record we wrote whole
            response = record.get("response") if isinstance(record, dict) else None
            if isinstance(response, dict) and response.get("status_code") == 200:
                cid = custom_id_of(record)
                if cid is not None:
                    done.add(cid)
    return done, complete


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
def _chat_token_ids(llm: LLM, messages: list) -> list[int]:
    """The prompt token ids LLM.chat makes of one conversation."""
    conv = text_parts_joined(messages)
    if not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in conv
    ):
        raise BadRequest(
            "body.messages must be objects with a str 'role' and a 'content' that is a str or "
            "a list of text parts"
        )
    tokenizer = llm.get_tokenizer()
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise BadRequest("the model's tokenizer has no chat template; use /v1/completions")
    try:
        for j, m in enumerate(conv):
            check_unicode(m["content"], f"body.messages[{j}].content")
    except ValueError as e:
        raise BadRequest(str(e)) from None
    try:
        text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # the template is code run over this request's data: its error
        raise BadRequest(f"the chat template failed on body.messages: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def checked_prompt(llm: LLM, req: BatchRequest) -> TokensPrompt:
    """req's prompt as token ids, once the checks generate makes before any work pass for req
    alone: a refusal is req's 400 and never stops the others."""
    if req.url == CHAT_URL:
        prompt = TokensPrompt(prompt_token_ids=_chat_token_ids(llm, req.body["messages"]))
    else:
        prompt = req.body["prompt"]
    try:
        [request] = llm.llm_engine.processor.requests([prompt], [req.params])
    except (ValueError, TypeError) as e:
        raise BadRequest(str(e).replace("prompts[0]", "the prompt")) from None
    return TokensPrompt(prompt_token_ids=request.token_ids)


def read_requests(
    llm: LLM, input_path: Path, done: set[str]
) -> tuple[list[BatchRequest], list[TokensPrompt], list[dict], int]:
    """The requests of input_path to serve and their checked prompts, the error records of
    the lines that cannot be served (in input order), and how many lines are already done."""
    defaults = llm.get_default_sampling_params()
    first_line: dict[str, int] = {}
    reqs: list[BatchRequest] = []
    prompts: list[TokensPrompt] = []
    errors: list[dict] = []
    skipped = 0
    # Bytes, decoded line by line: one line that is not UTF-8 is that line's error.
    with input_path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            cid = None
            try:
                obj = decode_line(raw)
                cid = custom_id_of(obj)
                if cid in done:
                    skipped += 1
                    continue
                if cid is not None:
                    first = first_line.setdefault(cid, lineno)
                    if first != lineno:
                        raise BadRequest(
                            f"custom_id {cid!r} repeats line {first}'s; each request needs "
                            "its own custom_id"
                        )
                req = parse_request(obj, defaults)
                prompt = checked_prompt(llm, req)
            except BadRequest as e:
                errors.append(_record(cid, 400, None, f"line {lineno}: {e}"))
                continue
            reqs.append(req)
            prompts.append(prompt)
    return reqs, prompts, errors, skipped


class ResultWriter:
    """Appends records to the output file, each whole and flushed at once; fsyncs every
    FSYNC_EVERY records or FSYNC_SECONDS, and on close. Cuts a torn last line off first."""

    def __init__(self, path: Path, complete: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        created = not path.exists()
        if not created and path.stat().st_size > complete:
            os.truncate(path, complete)
        self._file = path.open("ab")
        if created:
            # The new file's directory entry must last too, or a power cut loses the file.
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._unsynced = 0
        self._synced_at = time.monotonic()

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record).encode() + b"\n")
        self._file.flush()
        self._unsynced += 1
        if self._unsynced >= FSYNC_EVERY or time.monotonic() - self._synced_at >= FSYNC_SECONDS:
            self.sync()

    def sync(self) -> None:
        os.fsync(self._file.fileno())
        self._unsynced = 0
        self._synced_at = time.monotonic()

    def close(self) -> None:
        try:
            self.sync()
        finally:
            self._file.close()


def run_batch(
    llm: LLM, input_path: Path, output_path: Path, model_name: str, use_tqdm: bool = True
) -> dict[str, int]:
    """Serve every request of input_path without a status-200 record in output_path, appending
    each record as it becomes final; returns how many lines were served ("ok"), got an error
    record ("error") and were done already ("skipped")."""
    if output_path.exists() and os.path.samefile(input_path, output_path):
        raise ValueError(f"the output file is the input file ({str(input_path)!r})")
    done, complete = scan_output(output_path)
    reqs, prompts, errors, skipped = read_requests(llm, input_path, done)
    counts = {"ok": 0, "error": len(errors), "skipped": skipped}
    out = ResultWriter(output_path, complete)
    bar = tqdm(total=len(errors) + len(reqs), desc="Requests", disable=not use_tqdm)
    try:
        for record in errors:
            out.write(record)
            bar.update(1)
        if reqs:
            # One engine call over the whole file: continuous batching, each record written as
            # its request finishes. closing(): leaving early (an error, Ctrl-C) aborts the rest
            # and frees the LLM at once, not when the traceback lets the generator go.
            finished = llm.generate_iter(prompts, [r.params for r in reqs])
            with contextlib.closing(finished):
                for i, result in finished:
                    body = response_body(llm, reqs[i], result, model_name)
                    out.write(_record(reqs[i].custom_id, 200, body, None))
                    counts["ok"] += 1
                    bar.update(1)
    finally:
        bar.close()
        out.close()
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
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs a request may ask for (-1: no cap)")  # fmt: skip
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
        max_logprobs=args.max_logprobs,
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
        f"{counts['skipped']} already done in {args.output_file}"
    )
    return 0
