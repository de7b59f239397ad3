"""vLLM's logits processing for the hf engine's batched step, as tensor operations over the whole
batch: repetition, presence and frequency penalties, `min_tokens`, `logit_bias`,
`allowed_token_ids`, `bad_words`, structured output (grammar bitmasks, worker/engines/
structured.py). The draw itself and log-probabilities: worker/engines/sampling.py.

`RowProcessors` keeps one row per sequence of the running batch, in step with it as rows join
and leave. It exists only while some row asks for processing, so a batch where none does pays
nothing, and a row at its neutral values comes out bit for bit unchanged. The rules are vLLM's
(and Hugging Face's processor of the same name, where it has one): docs/design.md, "Logits
processing".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tasks.schemas import SamplingParams
from worker.engines.base import InvalidField

# The bias OpenAI and vLLM allow (and clamp to).
BIAS_MAX = 100.0


def needs_processing(p: SamplingParams) -> bool:
    return p.penalized or p.min_tokens > 0 or p.masked


def check(p: SamplingParams, tokenizer: Any, vocab: int) -> None:
    """InvalidField, naming the request's field, for what the job asks that this model cannot do:
    token ids outside its vocabulary, a bad word that is no token, a constraint that does not
    compile (compiled here once, so that admitting the job later finds it compiled)."""
    for name, ids in (("logit_bias", p.logit_bias), ("allowed_token_ids", p.allowed_token_ids or ())):
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise InvalidField(name, f"token id {bad[0]} is out of the vocabulary (0 to {vocab - 1})")
    if p.bad_words:
        bad_word_ids(tokenizer, p.bad_words)
    if p.structured_outputs is not None:
        from worker.engines.structured import grammars_for

        grammars_for(tokenizer, vocab).compile(p.structured_outputs)


def bad_word_ids(tokenizer: Any, words: Sequence[str]) -> list[tuple[int, ...]]:
    """Each bad word's token sequences: alone, and after a space where that tokenizes to a
    different first token (vLLM's SamplingParams.update_from_tokenizer, which takes the spaced
    one only if it has as many tokens: here " word" is banned too when it is one token and
    "word" two)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise InvalidField("bad_words", f"{word!r} is no token")
        out.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0]:
            out.append(spaced)
    return out


@dataclass
class RowProcessors:
    rep: torch.Tensor  # [B, 1] repetition penalty (1: off)
    pres: torch.Tensor  # [B, 1] presence penalty (0: off)
    freq: torch.Tensor  # [B, 1] frequency penalty (0: off)
    min_tokens: torch.Tensor  # [B] tokens before EOS / stop ids may come (0: off)
    produced: torch.Tensor  # [B] tokens generated so far
    seen: torch.Tensor | None = None  # [B, V] bool: in the prompt or the output (repetition)
    counts: torch.Tensor | None = None  # [B, V] float: times in the output (presence, frequency)
    stops: torch.Tensor | None = None  # [B, V] bool: what min_tokens holds back
    bias: torch.Tensor | None = None  # [B, V] float: logit_bias (0: none)
    banned: torch.Tensor | None = None  # [B, V] bool: outside allowed_token_ids, one-token bad words
    # Per row (None: none): bad words of several tokens (prefix, last), and the row's output so far.
    bad_seqs: list[list[tuple[tuple[int, ...], int]] | None] | None = None
    history: list[list[int] | None] | None = None
    # Per row: its grammar matcher (None: unconstrained), and the Grammars that made them.
    matchers: list[Any] | None = None
    grammars: Any = None

    # -- building ------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompts: Sequence[list[int]],
        min_tokens: Sequence[int],
        eos: int | None,
        vocab: int,
        outputs: Sequence[list[int]] | None = None,
        tokenizer: Any = None,
    ) -> RowProcessors | None:
        """Rows for newly admitted sequences; None if none of them needs any processing.
        `prompts`: the tokens each row's prefill fed (for a repetition penalty); `outputs`: the
        tokens each row generated already (a preempted row taken up again: its prompts include
        them), for the presence and frequency penalties and min_tokens. `min_tokens`: each
        row's, already capped at its max_new. `tokenizer`: for `bad_words` and structured output
        (the engine has checked them with `check`)."""
        if not any(needs_processing(p) for p in params):
            return None
        rows = len(params)
        procs = cls(
            rep=torch.tensor([[p.repetition_penalty] for p in params], dtype=torch.float32),
            pres=torch.tensor([[p.presence_penalty] for p in params], dtype=torch.float32),
            freq=torch.tensor([[p.frequency_penalty] for p in params], dtype=torch.float32),
            min_tokens=torch.tensor(list(min_tokens), dtype=torch.long),
            produced=torch.zeros(rows, dtype=torch.long),
        )
        if any(p.repetition_penalty != 1.0 for p in params):
            procs.seen = torch.zeros(rows, vocab, dtype=torch.bool)
            for row, (p, ids) in enumerate(zip(params, prompts)):
                if p.repetition_penalty != 1.0 and ids:
                    procs.seen[row, torch.tensor(ids)] = True
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            procs.counts = torch.zeros(rows, vocab, dtype=torch.float32)
        if outputs is not None:
            procs.produced = torch.tensor([len(o) for o in outputs], dtype=torch.long)
            for row, out in enumerate(outputs):
                if procs.counts is not None and out:
                    procs.counts[row] = torch.bincount(torch.tensor(out), minlength=vocab)[:vocab].float()
        if any(min_tokens):
            procs.stops = torch.zeros(rows, vocab, dtype=torch.bool)
            for row, (p, m) in enumerate(zip(params, min_tokens)):
                if m:
                    ids = [t for t in p.stop_token_ids if t < vocab]
                    if eos is not None and not p.ignore_eos:
                        ids.append(eos)
                    if ids:
                        procs.stops[row, torch.tensor(ids)] = True
        if any(p.masked for p in params):
            procs._build_masks(params, vocab, outputs or [[] for _ in params], tokenizer)
        return procs

    def _build_masks(self, params: Sequence[SamplingParams], vocab: int, outputs, tokenizer) -> None:
        rows = len(params)
        if any(p.logit_bias for p in params):
            self.bias = torch.zeros(rows, vocab, dtype=torch.float32)
            for row, p in enumerate(params):
                if p.logit_bias:
                    ids = torch.tensor([t for t in p.logit_bias if t < vocab], dtype=torch.long)
                    values = torch.tensor([p.logit_bias[t] for t in p.logit_bias if t < vocab])
                    self.bias[row, ids] = values.clamp(-BIAS_MAX, BIAS_MAX)
        seqs: list = [None] * rows
        for row, p in enumerate(params):
            if p.allowed_token_ids is not None or p.bad_words:
                if self.banned is None:
                    self.banned = torch.zeros(rows, vocab, dtype=torch.bool)
                if p.allowed_token_ids is not None:
                    self.banned[row] = True
                    self.banned[row, torch.tensor([t for t in p.allowed_token_ids if t < vocab])] = False
                for word in bad_word_ids(tokenizer, p.bad_words) if p.bad_words else ():
                    if len(word) == 1:
                        self.banned[row, word[0]] = True
                    else:
                        seqs[row] = (seqs[row] or []) + [(word[:-1], word[-1])]
        if any(seqs):
            self.bad_seqs = seqs
            self.history = [list(o) if s else None for s, o in zip(seqs, outputs)]
        if any(p.structured_outputs is not None for p in params):
            from worker.engines.structured import grammars_for

            self.grammars = grammars_for(tokenizer, vocab)
            self.matchers = [
                self.grammars.matcher(p.structured_outputs, out) if p.structured_outputs is not None else None
                for p, out in zip(params, outputs)
            ]

    @classmethod
    def neutral(cls, rows: int) -> RowProcessors:
        return cls(
            rep=torch.ones(rows, 1),
            pres=torch.zeros(rows, 1),
            freq=torch.zeros(rows, 1),
            min_tokens=torch.zeros(rows, dtype=torch.long),
            produced=torch.zeros(rows, dtype=torch.long),
        )

    @staticmethod
    def join(
        old: RowProcessors | None, new: RowProcessors | None, n_old: int, n_new: int, vocab: int
    ) -> RowProcessors | None:
        """The rows of `old` (n_old of them) followed by those of `new` (n_new). A side without
        processors gets neutral rows (their counts do not matter: nothing reads them)."""
        if old is None and new is None:
            return None
        old = old or RowProcessors.neutral(n_old)
        new = new or RowProcessors.neutral(n_new)

        def cat(a: torch.Tensor | None, b: torch.Tensor | None, dtype) -> torch.Tensor | None:
            if a is None and b is None:
                return None
            a = a if a is not None else torch.zeros(n_old, vocab, dtype=dtype)
            b = b if b is not None else torch.zeros(n_new, vocab, dtype=dtype)
            return torch.cat([a, b])

        def rows(a: list | None, b: list | None) -> list | None:
            if a is None and b is None:
                return None
            return (a if a is not None else [None] * n_old) + (b if b is not None else [None] * n_new)

        return RowProcessors(
            rep=torch.cat([old.rep, new.rep]),
            pres=torch.cat([old.pres, new.pres]),
            freq=torch.cat([old.freq, new.freq]),
            min_tokens=torch.cat([old.min_tokens, new.min_tokens]),
            produced=torch.cat([old.produced, new.produced]),
            seen=cat(old.seen, new.seen, torch.bool),
            counts=cat(old.counts, new.counts, torch.float32),
            stops=cat(old.stops, new.stops, torch.bool),
            bias=cat(old.bias, new.bias, torch.float32),
            banned=cat(old.banned, new.banned, torch.bool),
            bad_seqs=rows(old.bad_seqs, new.bad_seqs),
            history=rows(old.history, new.history),
            matchers=rows(old.matchers, new.matchers),
            grammars=old.grammars or new.grammars,
        )

    def select(self, idx: torch.Tensor) -> RowProcessors | None:
        """The rows in `idx`; None once none of them needs processing any more."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, idx)

        order = idx.tolist()

        def rows(a: list | None) -> list | None:
            picked = None if a is None else [a[i] for i in order]
            return picked if picked and any(x is not None for x in picked) else None

        out = RowProcessors(
            rep=pick(self.rep),
            pres=pick(self.pres),
            freq=pick(self.freq),
            min_tokens=pick(self.min_tokens),
            produced=pick(self.produced),
            seen=pick(self.seen),
            counts=pick(self.counts),
            stops=pick(self.stops),
            bias=pick(self.bias),
            banned=pick(self.banned),
            bad_seqs=rows(self.bad_seqs),
            history=rows(self.history),
            matchers=rows(self.matchers),
            grammars=self.grammars,
        )
        if not out._repeats():
            out.seen = None
        if not out._penalizes():
            out.counts = None
        if not out._holds_back():
            out.stops = None
        if out.bias is not None and not bool(out.bias.any()):
            out.bias = None
        if out.banned is not None and not bool(out.banned.any()):
            out.banned = None
        if out.bad_seqs is None:
            out.history = None
        if all(t is None for t in (out.seen, out.counts, out.stops, out.bias, out.banned, out.bad_seqs, out.matchers)):
            return None
        return out

    def head(self, rows: int) -> RowProcessors:
        """The first `rows` rows, as views: `update` on it counts into this one."""

        def pick(t):  # tensors as views; lists of the same (mutable) per-row objects
            return None if t is None else t[:rows]

        return RowProcessors(
            rep=pick(self.rep),
            pres=pick(self.pres),
            freq=pick(self.freq),
            min_tokens=pick(self.min_tokens),
            produced=pick(self.produced),
            seen=pick(self.seen),
            counts=pick(self.counts),
            stops=pick(self.stops),
            bias=pick(self.bias),
            banned=pick(self.banned),
            bad_seqs=pick(self.bad_seqs),
            history=pick(self.history),
            matchers=pick(self.matchers),
            grammars=self.grammars,
        )

    def _repeats(self) -> bool:
        return self.seen is not None and bool((self.rep != 1.0).any())

    def _penalizes(self) -> bool:
        return self.counts is not None and bool(((self.pres != 0.0) | (self.freq != 0.0)).any())

    def _holds_back(self) -> bool:
        return self.stops is not None and bool((self.produced < self.min_tokens).any())

    # -- each step -----------------------------------------------------------------------

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed logits (float32, a new tensor; `logits` is left as it is)."""
        raw = logits
        logits = logits.float()
        if self.bias is not None:
            logits = logits + self.bias
        if self.banned is not None:
            logits = logits.masked_fill(self.banned, float("-inf"))
        if self.bad_seqs is not None:
            logits = self._ban_sequences(logits)
        if self.seen is not None:
            penalized = torch.where(logits < 0, logits * self.rep, logits / self.rep)
            logits = torch.where(self.seen, penalized, logits)
        if self.counts is not None:
            logits = logits - self.freq * self.counts - self.pres * (self.counts > 0)
        if self.stops is not None:
            under = self.produced < self.min_tokens
            logits = logits.masked_fill(self.stops & under.unsqueeze(1), float("-inf"))
        if self.matchers is not None:
            from worker.engines.structured import constrains

            rows = [i for i, m in enumerate(self.matchers) if m is not None and constrains(m)]
            if rows:
                if logits is raw:  # the kernel writes in place; the raw logits stay as they are
                    logits = logits.clone()
                bitmask = self.grammars.bitmask(len(self.matchers))
                for i in rows:
                    self.matchers[i].fill_next_token_bitmask(bitmask, i)
                self.grammars.apply(logits, bitmask, rows)
        return logits

    def _ban_sequences(self, logits: torch.Tensor) -> torch.Tensor:
        """-inf for the last token of each bad word whose other tokens end the row's output."""
        rows, tokens = [], []
        for row, (seqs, out) in enumerate(zip(self.bad_seqs, self.history)):
            for prefix, last in seqs or ():
                if len(out) >= len(prefix) and tuple(out[len(out) - len(prefix) :]) == prefix:
                    rows.append(row)
                    tokens.append(last)
        if not rows:
            return logits
        return logits.index_put((torch.tensor(rows), torch.tensor(tokens)), torch.tensor(float("-inf")))

    def update(self, tokens: torch.Tensor) -> None:
        """Count the tokens just chosen, one per row."""
        col = tokens.view(-1, 1)
        if self.seen is not None:
            self.seen.scatter_(1, col, True)
        if self.counts is not None:
            self.counts.scatter_add_(1, col, torch.ones(col.shape, dtype=self.counts.dtype))
        self.produced += 1
        if self.history is not None or self.matchers is not None:
            chosen = tokens.tolist()
            for row, out in enumerate(self.history or ()):
                if out is not None:
                    out.append(chosen[row])
            for row, m in enumerate(self.matchers or ()):
                if m is not None and not m.is_terminated():
                    m.accept_token(chosen[row])
        if self.stops is not None and not self._holds_back():
            self.stops = None  # every row is past its min_tokens
