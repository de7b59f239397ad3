"""What each `genq` command does (`cmd_<name>`, given the client and the parsed arguments) and
the exit codes they return; genqueue/cli.py parses the command line and runs one of them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from genqueue import errors
from genqueue.client import Client, Restart, result_text

#: The exit codes (`genq --help` lists them).
OK, JOB_FAILED, USAGE, SERVER, AUTH = 0, 1, 2, 3, 4


def cmd_submit(client: Client, args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params: dict[str, Any] = {
        "model": args.model,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
    }
    params.update(args.param or {})
    job_id = client.submit(prompt, **params)
    if not (args.wait or args.stream):
        print(json.dumps({"id": job_id, "status": "queued"}) if args.json else job_id)
        return OK
    try:
        if args.stream:
            return _stream(client, job_id, args.max_wait)
        job = client.wait(job_id, args.max_wait)
    except KeyboardInterrupt:
        client._cancel_quietly(job_id)
        print(f"genq: cancelled job {job_id}", file=sys.stderr)
        raise
    except errors.WaitTimeout:
        print(f"genq: job {job_id} goes on; `genq get {job_id}` later", file=sys.stderr)
        raise
    if args.json:
        _print_json(job)
        return OK if job.get("status") == "succeeded" else JOB_FAILED
    print(result_text(job))
    return OK


def _stream(client: Client, job_id: str, max_wait: float | None) -> int:
    deadline = None if max_wait is None else time.monotonic() + max_wait
    out = sys.stdout
    tokens = client.stream(job_id)
    with tokens:
        for token in tokens:
            if isinstance(token, Restart):
                out.write("\n")
                print(f"genq: job {job_id} started over on another worker; its text starts again", file=sys.stderr)
            else:
                out.write(token)
            out.flush()
            if deadline is not None and time.monotonic() > deadline:
                out.write("\n")
                raise errors.WaitTimeout(None, "wait_timeout", f"job {job_id} still streaming after {max_wait:g} s")
    out.write("\n")
    return OK


def cmd_chat(client: Client, args: argparse.Namespace) -> int:
    message = sys.stdin.read() if args.message == "-" else args.message
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": message}
    ]
    params: dict[str, Any] = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        **_tools(args),
        **(args.param or {}),
    }
    answer = client.chat_completion(messages, args.max_wait, **params)
    if args.json:
        _print_json(answer)
        return OK
    message = answer["choices"][0]["message"]
    if message.get("content") is not None:
        print(message["content"])
    for call in message.get("tool_calls") or []:  # one JSON line per call
        print(json.dumps({"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])}))
    return OK


def _tools(args: argparse.Namespace) -> dict[str, Any]:
    """`tools` and `tool_choice` of `genq chat --tools FILE [--tool-choice C]`."""
    if args.tools is None:
        if args.tool_choice is not None:
            raise SystemExit("genq chat: --tool-choice needs --tools")
        return {}
    try:
        text = sys.stdin.read() if args.tools == "-" else Path(args.tools).read_text()
        tools = json.loads(text)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"genq chat: --tools {args.tools}: {exc}") from None
    tools = tools if isinstance(tools, list) else [tools]
    choice = args.tool_choice
    if choice not in (None, "auto", "none", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    return {"tools": tools, "tool_choice": choice}


def cmd_get(client: Client, args: argparse.Namespace) -> int:
    if args.wait:
        try:
            job = client.wait(args.id, args.wait)
        except errors.WaitTimeout as exc:
            job = exc.job  # as GET ?wait=: the job as it is by then
    else:
        job = client.get(args.id)
    _print_json(job)
    return OK if job.get("status") in ("queued", "running", "succeeded") else JOB_FAILED


def cmd_cancel(client: Client, args: argparse.Namespace) -> int:
    _print_json(client.cancel(args.id))
    return OK


def cmd_workers(client: Client, args: argparse.Namespace) -> int:
    ready = client.ready()
    if args.json:
        _print_json(ready)
        return OK
    workers = ready.get("workers") or []
    print(f"model {ready.get('model')}: {len(workers)} worker(s)")
    rows = [("NAME", "ENGINE", "CAPACITY", "HOST")] + [
        (str(w.get("name")), str(w.get("engine")), str(w.get("capacity")), str(w.get("host"))) for w in workers
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return OK


def cmd_stream(client: Client, args: argparse.Namespace) -> int:
    return _stream(client, args.id, args.max_wait)


def cmd_batch(client: Client, args: argparse.Namespace) -> int:
    try:
        open(args.input, "rb").close()
    except OSError as exc:
        print(f"genq: {args.input}: {exc.strerror or exc}", file=sys.stderr)
        return USAGE
    start = time.monotonic()
    code, problem = OK, None
    try:
        results = client.run_batch(
            args.input, progress=not args.no_progress, poll_interval=args.poll, timeout=args.max_wait
        )
    except errors.BatchError as exc:
        results, code, problem = exc.results or [], JOB_FAILED, exc
    ok = sum(1 for r in results if _line_ok(r))
    failed = len(results) - ok
    out = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")
    try:
        for line in results:
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    where = "stdout" if args.output == "-" else args.output
    print(
        f"genq: {ok} succeeded, {failed} failed in {time.monotonic() - start:.1f} s; output: {where}",
        file=sys.stderr,
    )
    if problem is not None:
        print(f"genq: {problem}", file=sys.stderr)
    return code if code != OK else (JOB_FAILED if failed else OK)


def cmd_embed(client: Client, args: argparse.Namespace) -> int:
    """Each non-empty line of the input one text; one JSON line out per text, in order:
    {"line": its line number, "embedding": [...]}. Requests of --batch-size texts, several at
    once (--concurrency): the workers pack their inputs into shared forwards."""
    from concurrent.futures import ThreadPoolExecutor

    if args.batch_size < 1 or args.concurrency < 1:
        print("genq: --batch-size and --concurrency are at least 1", file=sys.stderr)
        return USAGE
    source = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")  # noqa: SIM115
    with source:
        lines = [(n, text) for n, text in enumerate(source.read().splitlines(), 1) if text.strip()]
    chunks = [lines[i : i + args.batch_size] for i in range(0, len(lines), args.batch_size)]
    params = {"model": args.model, "dimensions": args.dimensions, "truncate_prompt_tokens": args.truncate}

    def one(chunk: list[tuple[int, str]]) -> list:
        return client.embed([text for _, text in chunk], **params)

    out = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")  # noqa: SIM115
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            for chunk, vectors in zip(chunks, pool.map(one, chunks), strict=True):
                for (n, _), vector in zip(chunk, vectors, strict=True):
                    out.write(json.dumps({"line": n, "embedding": vector}) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    print(f"genq: {len(lines)} texts embedded", file=sys.stderr)
    return OK


def _line_ok(line: dict) -> bool:
    response = line.get("response") or {}
    return line.get("error") is None and response.get("status_code") == 200


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, ensure_ascii=False))
