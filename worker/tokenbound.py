"""An upper bound on how many tokens a text becomes, read from the tokenizer's own structure
(its tokenizer.json), which the worker announces in its heartbeat (tasks/registry.py,
`TokenBound`): for every text t, `len(tok(t).input_ids) <= per_byte * utf8_bytes(t) + extra`.
The API compares that with the model's context to know, without asking a worker, that a prompt
surely fits (webapp/context.py); only a prompt whose bound does not fit is counted by a worker.

It is accepted for BPE, Unigram, WordPiece and WordLevel models behind the normalizers and
pre-tokenizers whose effect on a text's length is bounded (anything else: no bound, the API
counts every prompt), and checked once more on tricky texts at load (`bound_of`). Why it
holds, step by step: docs/design.md, "Does a prompt fit? Token bounds", "A tokenizer's bound".
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from tasks.registry import TokenBound

log = logging.getLogger(__name__)

# How many UTF-8 bytes a Unicode normalization form can make of one byte (the largest ratio of
# any code point; composing never adds bytes, so a text's ratio is at most its characters').
UNICODE_FORMS = {"NFC": 3, "NFD": 3, "NFKC": 11, "NFKD": 11}
# Normalizers that only remove characters.
SHORTENING = {"Strip", "StripAccents"}
# Pre-tokenizers that only split (or drop what they split on).
SPLITTING = {
    "Split",
    "Whitespace",
    "WhitespaceSplit",
    "Punctuation",
    "Digits",
    "UnicodeScripts",
    "CharDelimiterSplit",
    "BertPreTokenizer",
}
MODELS = {"BPE", "Unigram", "WordPiece", "WordLevel"}


class Unbounded(Exception):
    """The tokenizer does something this module cannot bound."""


@dataclass
class _Bound:
    """Bounds on the text as it goes through the steps, in terms of the original's UTF-8
    bytes B: its bytes <= fb * B + eb, its cost (module docstring) <= fc * B + ec; the `e`s
    are added once per segment. `split`: a step has split the segment into pieces (a later
    prefix would be added to each)."""

    fb: Fraction = Fraction(1)
    eb: Fraction = Fraction(0)
    fc: Fraction = Fraction(1)
    ec: Fraction = Fraction(0)
    byte_level: bool = False
    split: bool = False

    def lengthen(self, factor: Fraction | int) -> None:
        """The text's bytes grow by at most `factor`; its cost is at most its bytes."""
        self.fb, self.eb = self.fb * factor, self.eb * factor
        self.fc, self.ec = self.fb, self.eb

    def prefix(self, nbytes: int, cost: int, what: str) -> None:
        if self.split:
            raise Unbounded(f"{what} after a split adds to every piece")
        self.eb += nbytes
        self.ec += nbytes if self.byte_level else cost

    def replace(self, old: str, new: str, cost: Callable[[str], int]) -> None:
        """Every occurrence of `old` becomes `new`: each is a distinct stretch of the text."""
        old_b, new_b = len(old.encode()), len(new.encode())
        if not old:
            raise Unbounded("Replace of the empty string")
        if new_b > old_b:
            self.fb, self.eb = self.fb * Fraction(new_b, old_b), self.eb * Fraction(new_b, old_b)
        if self.byte_level:
            self.fc, self.ec = self.fb, self.eb
            return
        old_c, new_c = cost(old), cost(new)
        if new_c > old_c:
            self.fc, self.ec = self.fc * Fraction(new_c, old_c), self.ec * Fraction(new_c, old_c)


def analyse(spec: dict[str, Any], in_vocab: Callable[[str], bool], specials: int) -> tuple[int, int]:
    """(per_byte, extra) for the tokenizer described by `spec` (tokenizer.json as a dict):
    `in_vocab(s)` says whether `s` is one token of its vocabulary, `specials` is how many
    tokens it adds around a text. Raises Unbounded for anything not covered (module docstring)."""
    model = spec.get("model") or {}
    kind = model.get("type")
    if kind not in MODELS:
        raise Unbounded(f"model {kind}")
    fallback = bool(model.get("byte_fallback"))

    def cost(text: str) -> int:
        return sum(1 if in_vocab(c) or not fallback else len(c.encode()) for c in text)

    b = _Bound()
    for step in _steps(spec.get("normalizer")):
        _normalize(b, step, cost)
    for step in _steps(spec.get("pre_tokenizer")):
        _pre_tokenize(b, step, cost)
    per_byte = math.ceil(b.fc)
    seg_extra = math.ceil(b.ec)
    normalized = spec.get("normalizer") is not None
    for added in spec.get("added_tokens") or []:
        content = added.get("content") or ""
        if added.get("normalized") and normalized:
            raise Unbounded(f"added token {content!r} matched after normalization")
        # One token, and the next segment's additions, for at least its own bytes.
        if 1 + seg_extra > per_byte * len(content.encode()):
            raise Unbounded(f"added token {content!r} is too short to pay for a segment's prefix")
    return per_byte, seg_extra + specials


def _steps(node: dict | None) -> list[dict]:
    if node is None:
        return []
    if node.get("type") == "Sequence":
        inner = node.get("normalizers", node.get("pretokenizers"))
        if inner is None:
            raise Unbounded("a Sequence without steps")
        return [s for n in inner for s in _steps(n)]
    return [node]


def _normalize(b: _Bound, step: dict, cost: Callable[[str], int]) -> None:
    kind = step.get("type")
    if kind in UNICODE_FORMS:
        b.lengthen(UNICODE_FORMS[kind])
    elif kind in SHORTENING:
        pass
    elif kind == "Prepend":
        prefix = step.get("prepend", "")
        b.prefix(len(prefix.encode()), cost(prefix), "Prepend")
    elif kind == "Replace" and "String" in (step.get("pattern") or {}):
        b.replace(step["pattern"]["String"], step.get("content", ""), cost)
    else:
        raise Unbounded(f"normalizer {kind}")


def _pre_tokenize(b: _Bound, step: dict, cost: Callable[[str], int]) -> None:
    kind = step.get("type")
    if kind in SPLITTING:
        b.split = True
    elif kind == "ByteLevel":
        if b.byte_level:
            raise Unbounded("ByteLevel twice")
        b.byte_level = True
        b.fc, b.ec = b.fb, b.eb  # from here on every byte is a symbol
        if step.get("add_prefix_space"):
            b.prefix(1, 1, "ByteLevel's add_prefix_space")
        if step.get("use_regex", True):
            b.split = True
    elif kind == "Metaspace":
        if b.byte_level:
            raise Unbounded("Metaspace after ByteLevel")
        rep = step.get("replacement", "▁")
        b.replace(" ", rep, cost)
        # `prepend_scheme` (tokenizers >= 0.15) or `add_prefix_space` (older files).
        if step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never") != "never":
            b.prefix(len(rep.encode()), cost(rep), "Metaspace's prepend")
        if step.get("split", True):
            b.split = True
    else:
        raise Unbounded(f"pre-tokenizer {kind}")


# Texts the bound is tried on at load: plain, spaced, Unicode that normalization lengthens, the
# added tokens back to back and between single characters, control characters.
PROBES = [
    "a",
    " ",
    "Hello, world!",
    "  x  y  ",
    "\n\n\t ",
    " " * 64,
    "a " * 64,
    "\u0958\u0959\u095a",  # NFC makes two characters of each
    "\U0001d160\U0001d161",  # NFC: three each
    "\u0390\u03b0",  # NFD: three each
    "\ufdfa",  # NFKC: eighteen
    "ﬃ ﬄ ㎒",
    "¿Dónde está la biblioteca? 图书馆在哪里 🤗👍🏽",
    "\x00\x01\x7f\u200b\ufeff",
    "".join(chr(c) for c in range(32, 127)),
    "".join(chr(c) for c in range(0xA0, 0x250, 7)),
]


def bound_of(tok: Any) -> TokenBound:
    """The bound a worker announces for its tokenizer (`tok`: a transformers tokenizer):
    `per_byte` None when it has none, and the API has a worker count every prompt."""
    try:
        spec = json.loads(tok.backend_tokenizer.to_str())
        backend = tok.backend_tokenizer
        specials = max(tok.num_special_tokens_to_add(pair=False), len(tok("").input_ids))
        per_byte, extra = analyse(spec, lambda s: backend.token_to_id(s) is not None, specials)
    except Unbounded as exc:
        log.info("prompts are counted by a worker: no bound on this tokenizer's tokens (%s)", exc)
        return TokenBound(per_byte=None)
    except Exception as exc:  # noqa: BLE001 - no tokenizer.json (a slow tokenizer): no bound
        log.info("prompts are counted by a worker: the tokenizer has no structure to read (%s)", exc)
        return TokenBound(per_byte=None)
    added = [a["content"] for a in spec.get("added_tokens") or []][:32]
    probes = PROBES + ["".join(added), "x".join(added) + "x", " ".join(added)]
    for text in probes:
        n = len(tok(text).input_ids)
        if n > per_byte * len(text.encode()) + extra:
            log.warning(
                "prompts are counted by a worker: %r became %d tokens, above the bound %d per byte + %d",
                text,
                n,
                per_byte,
                extra,
            )
            return TokenBound(per_byte=None)
    return TokenBound(per_byte=per_byte, extra=extra)
