"""The hf engine's output processing: from each new token to text, stream events and results.

Detokenising incrementally (a token can complete a character its predecessor began), EOS,
stop tokens and stop strings (text that may begin a stop string is held back from the
stream), `max_new_tokens` and the model's context, log-probabilities in OpenAI's shape, and the
token events and results the engine's sink publishes together after each step.
"""

from __future__ import annotations

from concurrent.futures import Future

from tasks.schemas import GenerationResult, Logprobs
from tasks.streams import TokenEvent
from worker.engines.base import GenerationError, JobCancelled, Resolved
from worker.engines.scheduler import Seq


class OutputProcessor:
    def __init__(self, tok, eos: int | None, model: str, max_model_len: int | None):
        self.tok, self.eos, self.model, self.max_model_len = tok, eos, model, max_model_len
        self.events: list[tuple[str, TokenEvent]] = []
        self.resolved: list[Resolved] = []
        self._pieces: dict[int, str] = {}

    def take(self) -> tuple[list[tuple[str, TokenEvent]], list[Resolved]]:
        """The events and results since the last call, for the sink."""
        out = self.events, self.resolved
        self.events, self.resolved = [], []
        return out

    def advance(self, seq: Seq, token: int, lp: tuple | None = None) -> bool:
        """Add a token to a job; resolve it and return False if the job has finished."""
        params = seq.spec.params
        if token == self.eos and not params.ignore_eos:
            return self._resolve(seq, "eos")
        if token in seq.stop_ids:
            return self._resolve(seq, "stop")
        seq.out.append(token)
        if lp is not None:
            self._add_logprob(seq, token, *lp)
        delta = self._detokenize(seq)
        seq.text += delta
        if params.stop and delta:
            start = max(0, len(seq.text) - len(delta) - seq.holdback)
            found = [p for p in (seq.text.find(s, start) for s in params.stop) if p >= 0]
            if found:
                at = min(found)
                if params.include_stop_str_in_output:  # the stop string found first, kept
                    at += max(len(s) for s in params.stop if seq.text.find(s, start) == at)
                return self._resolve(seq, "stop", seq.text[:at])
        upto = max(seq.sent, len(seq.text) - seq.holdback)
        self._stream(seq, seq.text[seq.sent : upto])
        seq.sent = upto
        if len(seq.out) >= seq.max_new:
            return self._resolve(seq, "length")
        if self.max_model_len and len(seq.prompt_ids) + len(seq.out) >= self.max_model_len:
            return self._resolve(seq, "length")
        return True

    def fail(self, seq: Seq, why: str) -> None:
        """A job that leaves unfinished: cancelled, or past its deadline (keeping what it
        generated as a partial result)."""
        if why == "cancelled":
            seq.future.set_exception(JobCancelled(seq.spec.id))
            return
        partial = self.result(seq, "timeout", self._decode(seq, seq.out))
        seq.future.set_exception(GenerationError("timeout", seq.timeout_message, partial))

    def result(self, seq: Seq, reason: str, text: str) -> GenerationResult:
        ids = seq.spec.params.return_token_ids
        return GenerationResult(
            text=text,
            finish_reason=reason,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.out),
            cached_tokens=seq.cached,
            batch_size=max(seq.batch_peak, 1),
            model=self.model,
            logprobs=seq.lp,
            prompt_logprobs=self._prompt_logprobs(seq) if seq.prompt_lp is not None else None,
            prompt_token_ids=list(seq.prompt_ids) if ids else None,
            token_ids=list(seq.out) if ids else None,
        )

    def _prompt_logprobs(self, seq: Seq) -> list:
        """vLLM's shape: None for the first prompt token, then {token id: {logprob, rank,
        decoded_token}} for the token there and the likeliest ones."""
        out: list = [None]
        for token, value, rank, top in seq.prompt_lp:
            entry = {
                str(t): {"logprob": v, "rank": j + 1, "decoded_token": self._piece(t)} for j, (t, v) in enumerate(top)
            }
            entry[str(token)] = {"logprob": value, "rank": rank, "decoded_token": self._piece(token)}
            out.append(entry)
        return out

    def _decode(self, seq: Seq, tokens: list[int]) -> str:
        p = seq.spec.params
        if p.skip_special_tokens and p.spaces_between_special_tokens:
            return self.tok.decode(tokens, skip_special_tokens=True)
        return self.tok.decode(
            tokens,
            skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens,
        )

    def _resolve(self, seq: Seq, reason: str, text: str | None = None) -> bool:
        if text is None:
            text = self._decode(seq, seq.out)
        result = self.result(seq, reason, text)
        usage = {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "cached_tokens": result.cached_tokens,
        }
        self._stream(seq, text[seq.sent :], finish=reason, usage=usage)
        future: Future = seq.future
        self.resolved.append((future, result))
        return False

    def _detokenize(self, seq: Seq) -> str:
        """The text the newest token adds; empty while it ends inside a UTF-8 character."""
        before = self._decode(seq, seq.out[seq.prefix_off : seq.read_off])
        after = self._decode(seq, seq.out[seq.prefix_off :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            seq.prefix_off, seq.read_off = seq.read_off, len(seq.out)
            return after[len(before) :]
        return ""

    def _piece(self, token: int) -> str:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.tok.decode([token])
        return piece

    def _add_logprob(self, seq: Seq, token: int, chosen: float, top: list[tuple[int, float]]) -> None:
        piece = self._piece(token)
        alternatives = {self._piece(t): v for t, v in top}
        alternatives.setdefault(piece, chosen)
        for lp in (seq.lp, seq.lp_unsent) if seq.lp_unsent is not None else (seq.lp,):
            lp.tokens.append(piece)
            lp.token_logprobs.append(chosen)
            lp.top_logprobs.append(alternatives)
            lp.text_offset.append(seq.lp_offset)
        seq.lp_offset += len(piece)

    def _stream(self, seq: Seq, text: str, **final) -> None:
        if seq.spec.stream:
            lp = None
            if seq.lp_unsent is not None and seq.lp_unsent.tokens:
                lp, seq.lp_unsent = seq.lp_unsent.model_dump(), Logprobs()
            self.events.append((seq.spec.id, TokenEvent(seq.events, text, **final, logprobs=lp)))
        seq.events += 1
