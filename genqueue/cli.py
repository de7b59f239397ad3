"""`genq`: the genqueue API from the command line (`genq --help`, `genq <command> --help`).

Here: its arguments (`build_parser`) and `main`; what each command does, and the exit codes,
in genqueue/commands.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

from genqueue import errors
from genqueue.client import DEFAULT_URL, Client
from genqueue.commands import (
    AUTH,
    JOB_FAILED,
    OK,
    SERVER,
    USAGE,
    cmd_batch,
    cmd_cancel,
    cmd_chat,
    cmd_embed,
    cmd_get,
    cmd_stream,
    cmd_submit,
    cmd_workers,
)

EPILOG = f"""\
environment:
  GENQ_URL          the API (default {DEFAULT_URL}); --url overrides it
  GENQ_API_KEY      sent as "Authorization: Bearer <key>"; --api-key overrides it

exit codes:
  0  ok
  1  the job failed, was cancelled or expired (submit --wait/--stream, get); a batch failed,
     was cancelled or has failed lines
  2  usage: bad arguments, or the server refused the request (400 invalid, 404 unknown id,
     409 already ended, 413 too large)
  3  server or connection error: unreachable, 5xx (no worker, Redis down), 429 queue full or
     quota used up, or --max-wait ran out (the job goes on)
  4  authentication: missing or wrong API key (401/403)
"""


def exit_code(exc: errors.GenqError) -> int:
    if isinstance(exc, (errors.JobError, errors.BatchError)):
        return JOB_FAILED
    if isinstance(exc, errors.AuthError):
        return AUTH
    if isinstance(exc, (errors.BadRequest, errors.NotFound, errors.Conflict)):
        return USAGE
    return SERVER


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help(sys.stderr)
        return USAGE
    client = Client(getattr(args, "url", None), getattr(args, "api_key", None), timeout=getattr(args, "timeout", 30.0))
    try:
        return args.run(client, args)
    except errors.GenqError as exc:
        print(f"genq: {exc}", file=sys.stderr)
        return exit_code(exc)
    except KeyboardInterrupt:
        print("genq: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `genq ... | head`
        sys.stderr.close()
        return OK
    finally:
        client.close()


# -- arguments ---------------------------------------------------------------------------


def _key_value(raw: str) -> tuple[str, Any]:
    name, sep, value = raw.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{raw!r}: NAME=VALUE")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


class _Params(argparse.Action):
    def __call__(self, parser, namespace, value, option_string=None):
        params = dict(getattr(namespace, self.dest, None) or {})
        params[value[0]] = value[1]
        setattr(namespace, self.dest, params)


def _wrap(text: str) -> str:
    return textwrap.fill(text, 88)


def build_parser() -> argparse.ArgumentParser:
    # The connection options work before and after the command (`genq --url U get ID` and
    # `genq get ID --url U`): SUPPRESS keeps a subcommand's default from hiding the other.
    common = argparse.ArgumentParser(add_help=False)
    conn = common.add_argument_group("connection")
    conn.add_argument("--url", default=argparse.SUPPRESS, help=f"the API (default: $GENQ_URL, else {DEFAULT_URL})")
    conn.add_argument("--api-key", default=argparse.SUPPRESS, help="API key (default: $GENQ_API_KEY)")
    conn.add_argument(
        "--timeout", type=float, default=argparse.SUPPRESS, metavar="S", help="seconds per HTTP request (default 30)"
    )
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="genq",
        description="Submit, follow and cancel genqueue jobs; run batches.",
        epilog=EPILOG,
        formatter_class=fmt,
        parents=[common],
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    p = sub.add_parser(
        "submit",
        parents=[common],
        epilog=EPILOG,
        formatter_class=fmt,
        help="queue a job; print its id, or with --wait its text, or with --stream its tokens",
        description=_wrap(
            "Queue a job (POST /v1/jobs). Prints its id; with --wait the completion once it "
            "has ended; with --stream its tokens as they are generated (resuming after a dropped "
            "connection). Ctrl-C during --wait/--stream cancels the job."
        ),
    )
    p.add_argument("prompt", help='the prompt ("-": read it from stdin)')
    p.add_argument("--model", help="a served model (default: the API's)")
    p.add_argument("--max-new-tokens", type=int, metavar="N")
    p.add_argument("--temperature", type=float, metavar="T", help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, metavar="P")
    p.add_argument("--top-k", type=int, metavar="K")
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", metavar="TEXT", help="a stop string (repeatable)")
    p.add_argument(
        "--param",
        type=_key_value,
        action=_Params,
        metavar="NAME=VALUE",
        help="any other job field (VALUE as JSON, else a string), e.g. --param ignore_eos=true",
    )
    how = p.add_mutually_exclusive_group()
    how.add_argument("--wait", action="store_true", help="wait for the job and print its text")
    how.add_argument("--stream", action="store_true", help="print its tokens as they come")
    p.add_argument("--max-wait", type=float, metavar="S", help="with --wait/--stream: give up after S seconds (exit 3)")
    p.add_argument("--json", action="store_true", help="print the job as JSON instead of the id or the text")
    p.set_defaults(run=cmd_submit)

    p = sub.add_parser(
        "chat",
        parents=[common],
        epilog=EPILOG,
        formatter_class=fmt,
        help="send a message to the model's chat template; print the reply",
        description=_wrap(
            "Send one user message (after --system, if given) to POST /v1/chat/completions, "
            "wait, and print the assistant's reply (or with --json the whole answer)."
        ),
    )
    p.add_argument("message", help='the user\'s message ("-": read it from stdin)')
    p.add_argument("--system", metavar="TEXT", help="a system message before it")
    p.add_argument("--model", help="a served model (default: the API's)")
    p.add_argument("--max-tokens", type=int, metavar="N")
    p.add_argument("--temperature", type=float, metavar="T", help="OpenAI's default is 1; 0 is greedy")
    p.add_argument("--seed", type=int)
    p.add_argument(
        "--param",
        type=_key_value,
        action=_Params,
        metavar="NAME=VALUE",
        help="any other field of the request (VALUE as JSON, else a string), e.g. --param top_p=0.9",
    )
    p.add_argument(
        "--tools",
        metavar="FILE",
        help='the functions the model may call: a JSON file of OpenAI\'s `tools` list ("-": stdin); '
        "the reply's calls print as JSON lines {name, arguments}",
    )
    p.add_argument(
        "--tool-choice",
        metavar="CHOICE",
        help='with --tools: "auto" (the default; needs the server\'s GENQ_TOOL_CALL_PARSER), "none", '
        '"required", or a function\'s name (forced to call it)',
    )
    p.add_argument("--max-wait", type=float, metavar="S", help="give up after S seconds")
    p.add_argument("--json", action="store_true", help="print the whole answer as JSON")
    p.set_defaults(run=cmd_chat)

    p = sub.add_parser(
        "get",
        parents=[common],
        epilog=EPILOG,
        formatter_class=fmt,
        help="print a job (JSON)",
        description=_wrap("Print a job as JSON (GET /v1/jobs/ID). Exit 1 if it failed, was cancelled or expired."),
    )
    p.add_argument("id")
    p.add_argument("--wait", type=float, metavar="S", help="first wait up to S seconds for it to end (as GET ?wait=S)")
    p.set_defaults(run=cmd_get)

    p = sub.add_parser(
        "stream",
        parents=[common],
        epilog=EPILOG,
        formatter_class=fmt,
        help="print a job's tokens as they come (re-attach to a running job)",
        description=_wrap(
            "Print the tokens of a job (GET /v1/jobs/ID/stream): those generated so far, then "
            "the rest as they come, resuming after a dropped connection. Works for a queued, running or "
            "finished job (a replay). Exit 1 if it failed, was cancelled or expired."
        ),
    )
    p.add_argument("id")
    p.add_argument("--max-wait", type=float, metavar="S", help="give up after S seconds (exit 3; the job goes on)")
    p.set_defaults(run=cmd_stream)

    p = sub.add_parser(
        "cancel",
        parents=[common],
        epilog=EPILOG,
        formatter_class=fmt,
        help="cancel a queued or running job",
        description=_wrap(
            "Cancel a queued or running job (POST /v1/jobs/ID/cancel) and print it. "
            "Exit 2 if it had already ended (409)."
        ),
    )
    p.add_argument("id")
    p.set_defaults(run=cmd_cancel)

    p = sub.add_parser(
        "batch",
        parents=[common],
        epilog=EPILOG,
        formatter_class=fmt,
        help="run a JSONL file of OpenAI batch requests, with a progress bar",
        description=_wrap(
            "Upload IN (OpenAI batch lines: {custom_id, method, url, body}) with POST /v1/files, "
            "create a batch for /v1/completions, show its progress (done/total, failed, rate, ETA) on "
            "stderr until it ends, then write its output lines ({id, custom_id, response, error}) in "
            "input order. Exit 0 if every line succeeded, 1 if some failed or the batch did. "
            "Ctrl-C cancels the batch."
        ),
    )
    p.add_argument("input", metavar="IN", help="the input JSONL file")
    p.add_argument("-o", "--output", default="-", metavar="OUT", help="where to write the output (default: stdout)")
    p.add_argument("--poll", type=float, default=1.0, metavar="S", help="seconds between progress polls (default 1)")
    p.add_argument("--max-wait", type=float, metavar="S", help="give up after S seconds (exit 3; the batch goes on)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_batch)

    p = sub.add_parser(
        "embed",
        parents=[common],
        epilog=EPILOG,
        formatter_class=fmt,
        help="embed each line of a text file (POST /v1/embeddings)",
        description=_wrap(
            "Embed each non-empty line of IN ('-': stdin) with an embedding model's workers (POST "
            "/v1/embeddings, --batch-size lines per request, --concurrency requests at once) and write one "
            'JSON line per text, in order: {"line": N, "embedding": [...]}. Exit 2 if the server refuses '
            "a request (an empty or too long line: see truncate)."
        ),
    )
    p.add_argument("input", metavar="IN", help="the text file, one text per line ('-': stdin)")
    p.add_argument("-o", "--output", default="-", metavar="OUT", help="where to write the vectors (default: stdout)")
    p.add_argument("--model", help="the embedding model (default: the API's default model)")
    p.add_argument("--batch-size", type=int, default=64, metavar="N", help="lines per request (default 64)")
    p.add_argument("--concurrency", type=int, default=4, metavar="N", help="requests at once (default 4)")
    p.add_argument("--dimensions", type=int, metavar="D", help="cut each vector to D dimensions (Matryoshka models)")
    p.add_argument(
        "--truncate", type=int, metavar="K", help="cut each line to K tokens (-1: the model's limit) instead of a 400"
    )
    p.set_defaults(run=cmd_embed)

    p = sub.add_parser(
        "workers",
        parents=[common],
        epilog=EPILOG,
        formatter_class=fmt,
        help="the live workers serving the default model (from /readyz)",
        description=_wrap("List the live workers that serve the API's default model (GET /readyz). Exit 3 if none."),
    )
    p.add_argument("--json", action="store_true", help="print /readyz's JSON")
    p.set_defaults(run=cmd_workers)
    return parser


if __name__ == "__main__":
    sys.exit(main())
