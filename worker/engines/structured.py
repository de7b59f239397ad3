"""Structured output for the hf engine: vLLM's `structured_outputs` (JSON Schema, any JSON
object, regex, choice, EBNF/Lark grammar) compiled by xgrammar, the library vLLM uses.

A compiled grammar is checked once against the tokenizer's vocabulary; each constrained row
then has a `GrammarMatcher`, which fills the row's bitmask of allowed tokens before each step
and accepts the token chosen after it (worker/engines/logits.py). JSON follows vLLM's xgrammar
backend except that whitespace runs are bounded (WHITESPACE_MAX) and strings with
`minLength`/`maxLength` exclude control characters (`string_lengths`). xgrammar is imported on
first use: a worker whose jobs never ask for structured output never loads it. Details:
docs/design.md, "Structured output".
"""

from __future__ import annotations

import json
import re
import threading
from functools import lru_cache
from typing import Any

from tasks.schemas import StructuredOutput
from worker.engines.base import InvalidField

# The most whitespace characters between two JSON tokens (xgrammar's max_whitespace_cnt).
WHITESPACE_MAX = 2
# The compiled grammars one worker keeps (xgrammar's own cache, in bytes).
CACHE_BYTES = 64 << 20


class GrammarError(InvalidField):
    """The constraint cannot be compiled (`field`: the request's field, the message: why)."""


class Grammars:
    """Compiles constraints for one tokenizer and vocabulary size (the model's logits' width,
    which may exceed the tokenizer's: the extra ids are never allowed)."""

    def __init__(self, tokenizer: Any, vocab: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab = vocab
        self.tokenizer = tokenizer
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_limit_bytes=CACHE_BYTES)
        self._lock = threading.Lock()

    def compile(self, so: StructuredOutput):
        """The compiled grammar (xgrammar caches it: a second job with the same constraint
        costs a lookup); GrammarError for one that is not valid."""
        c = self.compiler
        ws: dict[str, Any] = (
            dict(any_whitespace=False, separators=(",", ":"))
            if so.disable_any_whitespace
            else dict(any_whitespace=True, max_whitespace_cnt=WHITESPACE_MAX)
        )
        with self._lock:  # Celery threads check (compile) while the scheduler builds rows
            try:
                if so.json_schema is not None:
                    return c.compile_json_schema(json.dumps(string_lengths(json.loads(so.json_schema))), **ws)
                if so.json_object:
                    return c.compile_json_schema('{"type": "object"}', **ws)
                if so.regex is not None:
                    return c.compile_regex(so.regex)
                if so.choice is not None:
                    return c.compile_grammar(choice_grammar(so.choice))
                if looks_like_lark(so.grammar):
                    return c.compile_lark(so.grammar)
                return c.compile_grammar(so.grammar)
            except (RuntimeError, ValueError, TypeError) as exc:
                raise GrammarError(field_of(so), first_line(exc)) from None

    def matcher(self, so: StructuredOutput, accepted: list[int] = ()):
        """A matcher at the grammar's start, or past `accepted` (a preempted row taken up
        again). With `so.after` (the end of a reasoning span), one that allows every token
        until the output holds that text (`Deferred`)."""
        m = Deferred(self, so) if so.after else self.xgr.GrammarMatcher(self.compile(so))
        for t in accepted:
            m.accept_token(t)
        return m

    def bitmask(self, rows: int):
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def apply(self, logits, bitmask, rows: list[int]) -> None:
        """Disallowed tokens of `rows` (of `logits`, float32 on the CPU, in place) to -inf."""
        self.xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab, indices=rows)


def constrains(m: Any) -> bool:
    """Whether a row's matcher masks its next token (not ended, not waiting for its start)."""
    return not m.is_terminated() and not getattr(m, "waiting", False)


class Deferred:
    """A row's matcher that starts once the row's output holds `so.after` (the end of a
    reasoning span, `</think>`), as vLLM applies structured output to what follows the
    reasoning: before, every token is allowed; from the token that completes that text on,
    the constraint holds (text in that same token after the tag is not constrained)."""

    # Tokens decoded from the row's end to look for the tag (far more than any tag's tokens).
    WINDOW = 16

    def __init__(self, grammars: Grammars, so: StructuredOutput):
        self.grammars = grammars
        self.so = so
        self.inner = None
        self.tail: list[int] = []

    @property
    def waiting(self) -> bool:
        return self.inner is None

    def is_terminated(self) -> bool:
        return self.inner is not None and self.inner.is_terminated()

    def accept_token(self, token: int) -> bool:
        if self.inner is not None:
            return self.inner.accept_token(token)
        self.tail = (self.tail + [token])[-self.WINDOW :]
        if self.so.after in self.grammars.tokenizer.decode(self.tail):
            self.inner = self.grammars.xgr.GrammarMatcher(self.grammars.compile(self.so))
        return True

    def fill_next_token_bitmask(self, bitmask, i: int) -> None:
        self.inner.fill_next_token_bitmask(bitmask, i)


@lru_cache(maxsize=8)
def _grammars(tokenizer_id: int, tokenizer: Any, vocab: int) -> Grammars:
    return Grammars(tokenizer, vocab)


def grammars_for(tokenizer: Any, vocab: int) -> Grammars:
    """The engine's Grammars (one per tokenizer and vocabulary, made on first use)."""
    return _grammars(id(tokenizer), tokenizer, vocab)


def string_lengths(schema: Any) -> Any:
    """`schema` with a `pattern` for each string that has a length and no pattern, format,
    enum or const: JSON's characters that need no escape, from minLength to maxLength of them."""
    if isinstance(schema, list):
        return [string_lengths(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: string_lengths(v) if isinstance(v, (dict, list)) and k not in ("enum", "const", "default", "examples") else v
        for k, v in schema.items()
    }
    sized = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and sized and not {"pattern", "format", "enum", "const"} & out.keys():
        low, high = int(out.get("minLength", 0)), out.get("maxLength")
        upper = "" if high is None else int(high)
        out["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{low},{upper}}}$'
    return out


def field_of(so: StructuredOutput) -> str:
    for name, field in (("json_schema", "json"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar")):
        if getattr(so, name) is not None:
            return f"structured_outputs.{field}"
    return "structured_outputs.json_object"


def first_line(exc: Exception) -> str:
    """xgrammar's message without its time stamp and source location."""
    text = str(exc).strip() or type(exc).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[0])[:300]


def choice_grammar(choices: list[str]) -> str:
    """`root ::= "a" | "b"`, each choice an escaped EBNF string (as vLLM's choice_as_grammar)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def looks_like_lark(grammar: str) -> bool:
    """Lark (`start: ...`, `rule: ...`) rather than xgrammar's EBNF (`root ::= ...`), as vLLM
    tells them apart."""
    lines = [ln.strip() for ln in grammar.splitlines() if ln.strip() and not ln.strip().startswith(("#", "//"))]
    return bool(lines) and "::=" not in grammar and any(":" in ln for ln in lines)
