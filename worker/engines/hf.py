"""The Hugging Face transformers engine, with continuous batching.

One scheduler thread owns the model. Between two decode steps it admits every job that has
arrived (one left-padded prefill for all of them, whose KV cache is then joined to the running
batch) and drops every job that has finished, been cancelled or run out of time, so a job never
waits for a whole batch to end before it starts. Each decode step feeds every running job's
last token at once. Positions come from the attention mask (OPT derives them from its
cumulative sum), so the left padding that joins sequences of different lengths is invisible to
the model; columns that every row pads are trimmed whenever rows leave.

Greedy decoding here gives the same tokens as `model.generate(do_sample=False)` on the same
prompt, which the tests check through the whole queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.utils import logging as hf_logging

from tasks.config import Settings
from tasks.schemas import GenerationResult, JobSpec
from tasks.streams import TokenEvent
from worker.engines.base import DirectSink, Engine, GenerationError, JobCancelled, Resolved, Sink

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Seq:
    spec: JobSpec
    prompt_ids: list[int]
    max_new: int
    deadline: float
    future: Future = field(default_factory=Future)
    generator: torch.Generator | None = None
    out: list[int] = field(default_factory=list)
    batch_peak: int = 0
    # Incremental detokenization: `text` is the completion so far; tokens from `prefix_off`
    # on are decoded again each step (a token can complete a character its predecessor began).
    text: str = ""
    prefix_off: int = 0
    read_off: int = 0
    sent: int = 0  # characters of `text` already streamed
    events: int = 0  # token events streamed

    @property
    def holdback(self) -> int:
        """Characters kept back from the stream: they may turn out to begin a stop string."""
        stops = self.spec.params.stop
        return max(map(len, stops)) - 1 if stops else 0


class HFEngine(Engine):
    name = "hf"

    def __init__(self, settings: Settings, sink: Sink | None = None):
        self.sink = sink or DirectSink()
        self.model = settings.served_model
        self.capacity = settings.max_batch_size
        self.default_max_new = settings.default_max_new_tokens
        self.job_timeout = settings.job_timeout
        hf_logging.disable_progress_bar()
        self.tok = AutoTokenizer.from_pretrained(settings.model)
        self.lm = AutoModelForCausalLM.from_pretrained(
            settings.model, dtype=getattr(torch, settings.dtype)
        ).eval()
        cfg = self.lm.config
        self.max_model_len = getattr(cfg, "max_position_embeddings", None)
        self.eos = self.tok.eos_token_id if self.tok.eos_token_id is not None else cfg.eos_token_id
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos

        self._inbox: queue.SimpleQueue[_Seq | None] = queue.SimpleQueue()
        self._events: list[tuple[str, TokenEvent]] = []
        self._resolved: list[Resolved] = []
        self._cancel_lock = threading.Lock()
        self._cancelled: set[str] = set()
        self._closed = threading.Event()
        # The running batch: one row per sequence. The cache and `_mask` cover every token fed
        # so far; `_next` holds each row's newest token, which the next step feeds.
        self._seqs: list[_Seq] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None
        self._next: torch.Tensor | None = None
        self._thread = threading.Thread(target=self._run, name="genq-scheduler", daemon=True)
        self._thread.start()

    # -- called from Celery task threads ---------------------------------------------------

    def submit(self, spec: JobSpec) -> Future[GenerationResult]:
        if self._closed.is_set():
            raise GenerationError("engine_closed", "the engine is shutting down")
        ids = self.tok(spec.prompt).input_ids
        max_new = spec.params.max_new_tokens or self.default_max_new
        if self.max_model_len and len(ids) + max_new > self.max_model_len:
            raise GenerationError(
                "prompt_too_long",
                f"the prompt has {len(ids)} tokens; with max_new_tokens={max_new} that exceeds "
                f"the model's context of {self.max_model_len} tokens",
            )
        seq = _Seq(spec, ids, max_new, time.monotonic() + self.job_timeout)
        if not spec.params.greedy:
            seq.generator = torch.Generator()
            if spec.params.seed is None:
                seq.generator.seed()
            else:
                seq.generator.manual_seed(spec.params.seed)
        self._inbox.put(seq)
        return seq.future

    def cancel(self, job_id: str) -> None:
        with self._cancel_lock:
            self._cancelled.add(job_id)

    def close(self) -> None:
        self._closed.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)

    # -- the scheduler thread --------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while not self._closed.is_set():
                new = self._take()
                try:
                    self._step(new)
                except Exception as exc:  # a failed forward fails its batch, not the worker
                    log.exception("engine step failed")
                    for future, result in self._resolved:
                        future.set_result(result)
                    for seq in self._seqs + new:
                        if not seq.future.done():
                            seq.future.set_exception(GenerationError("engine_error", repr(exc)))
                    self._select([])
                    self._events, self._resolved = [], []
        for seq in self._seqs:
            seq.future.set_exception(GenerationError("engine_closed", "the worker stopped"))
        while True:
            try:
                seq = self._inbox.get_nowait()
            except queue.Empty:
                return
            if seq is not None:
                seq.future.set_exception(GenerationError("engine_closed", "the worker stopped"))

    def _take(self) -> list[_Seq]:
        """Jobs that arrived since the last step; blocks only while nothing is running."""
        new: list[_Seq] = []
        room = self.capacity - len(self._seqs)
        if not self._seqs:
            try:
                item = self._inbox.get(timeout=0.5)
            except queue.Empty:
                return new
            if item is None:
                return new
            new.append(item)
        while len(new) < room:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is None:
                break
            new.append(item)
        return new

    def _step(self, new: list[_Seq]) -> None:
        self._reap(new)
        if new:
            self._admit(new)
            self._flush()  # the new jobs' first tokens go out now, not a decode step later
        if self._seqs:
            self._decode()
        self._flush()

    def _flush(self) -> None:
        if self._events or self._resolved:
            self.sink.emit(self._events, self._resolved)
            self._events, self._resolved = [], []

    def _reap(self, new: list[_Seq]) -> None:
        """Fail cancelled and expired jobs, running or just arrived."""
        with self._cancel_lock:
            cancelled, self._cancelled = self._cancelled, set()
        now = time.monotonic()

        def gone(seq: _Seq) -> bool:
            if seq.spec.id in cancelled:
                seq.future.set_exception(JobCancelled(seq.spec.id))
                return True
            if now > seq.deadline:
                seq.future.set_exception(
                    GenerationError("timeout", f"the job ran longer than {self.job_timeout} s")
                )
                return True
            return False

        new[:] = [s for s in new if not gone(s)]
        if self._seqs:
            keep = [i for i, s in enumerate(self._seqs) if not gone(s)]
            if len(keep) < len(self._seqs):
                self._select(keep)

    def _admit(self, new: list[_Seq]) -> None:
        """Prefill the new jobs together and join them to the running batch."""
        width = max(len(s.prompt_ids) for s in new)
        ids = torch.full((len(new), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(new), width), dtype=torch.long)
        for row, seq in enumerate(new):
            n = len(seq.prompt_ids)
            ids[row, width - n :] = torch.tensor(seq.prompt_ids)
            mask[row, width - n :] = 1
        out = self.lm(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        first = self._sample(new, out.logits[:, -1, :])
        self._join(new, out.past_key_values, mask, first.view(-1, 1))
        base = len(self._seqs) - len(new)
        self._settle(first.tolist(), offset=base)

    def _join(self, new: list[_Seq], cache: DynamicCache, mask: torch.Tensor, nxt) -> None:
        if not self._seqs:
            self._seqs, self._cache, self._mask, self._next = list(new), cache, mask, nxt
            return
        old_len, new_len = self._mask.shape[1], mask.shape[1]
        width = max(old_len, new_len)

        def lpad(x: torch.Tensor, n: int) -> torch.Tensor:
            return F.pad(x, (0, 0, n, 0)) if n else x

        layers = [
            (
                torch.cat([lpad(a.keys, width - old_len), lpad(b.keys, width - new_len)]),
                torch.cat([lpad(a.values, width - old_len), lpad(b.values, width - new_len)]),
            )
            for a, b in zip(self._cache.layers, cache.layers)
        ]
        self._cache = DynamicCache(layers)
        self._mask = torch.cat([F.pad(self._mask, (width - old_len, 0)), F.pad(mask, (width - new_len, 0))])
        self._next = torch.cat([self._next, nxt])
        self._seqs.extend(new)

    def _decode(self) -> None:
        batch = len(self._seqs)
        for seq in self._seqs:
            seq.batch_peak = max(seq.batch_peak, batch)
        mask = F.pad(self._mask, (0, 1), value=1)
        out = self.lm(
            input_ids=self._next, attention_mask=mask, past_key_values=self._cache, use_cache=True
        )
        self._mask, self._cache = mask, out.past_key_values
        tokens = self._sample(self._seqs, out.logits[:, -1, :])
        self._next = tokens.view(-1, 1)
        self._settle(tokens.tolist())

    def _settle(self, tokens: list[int], offset: int = 0) -> None:
        """Record one new token per row from `offset` on; drop the rows that finished."""
        keep = list(range(offset))
        for i, token in enumerate(tokens, start=offset):
            if self._advance(self._seqs[i], token):
                keep.append(i)
        if len(keep) < len(self._seqs):
            self._select(keep)

    def _advance(self, seq: _Seq, token: int) -> bool:
        """Add a token to a job; resolve it and return False if the job has finished."""
        params = seq.spec.params
        if token == self.eos and not params.ignore_eos:
            return self._resolve(seq, "eos")
        seq.out.append(token)
        delta = self._detokenize(seq)
        seq.text += delta
        if params.stop and delta:
            start = max(0, len(seq.text) - len(delta) - seq.holdback)
            found = [p for p in (seq.text.find(s, start) for s in params.stop) if p >= 0]
            if found:
                return self._resolve(seq, "stop", seq.text[: min(found)])
        upto = max(seq.sent, len(seq.text) - seq.holdback)
        self._stream(seq, seq.text[seq.sent : upto])
        seq.sent = upto
        if len(seq.out) >= seq.max_new:
            return self._resolve(seq, "length")
        if self.max_model_len and len(seq.prompt_ids) + len(seq.out) >= self.max_model_len:
            return self._resolve(seq, "length")
        return True

    def _detokenize(self, seq: _Seq) -> str:
        """The text the newest token adds; empty while it ends inside a UTF-8 character."""
        before = self.tok.decode(seq.out[seq.prefix_off : seq.read_off], skip_special_tokens=True)
        after = self.tok.decode(seq.out[seq.prefix_off :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            seq.prefix_off, seq.read_off = seq.read_off, len(seq.out)
            return after[len(before) :]
        return ""

    def _stream(self, seq: _Seq, text: str, **final) -> None:
        if seq.spec.stream:
            self._events.append((seq.spec.id, TokenEvent(seq.events, text, **final)))
        seq.events += 1

    def _resolve(self, seq: _Seq, reason: str, text: str | None = None) -> bool:
        if text is None:
            text = self.tok.decode(seq.out, skip_special_tokens=True)
        result = GenerationResult(
            text=text,
            finish_reason=reason,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.out),
            batch_size=max(seq.batch_peak, 1),
            model=self.model,
        )
        usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens}
        self._stream(seq, text[seq.sent :], finish=reason, usage=usage)
        self._resolved.append((seq.future, result))
        return False

    def _select(self, keep: list[int]) -> None:
        """Keep only the rows in `keep`, trimming padding that no remaining row needs."""
        if not keep:
            self._seqs, self._cache, self._mask, self._next = [], None, None, None
            return
        idx = torch.tensor(keep)
        mask = self._mask.index_select(0, idx)
        pad = int((mask.cumsum(1) == 0).sum(1).min())
        self._cache = DynamicCache(
            [
                (layer.keys.index_select(0, idx)[:, :, pad:], layer.values.index_select(0, idx)[:, :, pad:])
                for layer in self._cache.layers
            ]
        )
        self._mask = mask[:, pad:]
        self._next = self._next.index_select(0, idx)
        self._seqs = [self._seqs[i] for i in keep]

    @staticmethod
    def _sample(seqs: list[_Seq], logits: torch.Tensor) -> torch.Tensor:
        tokens = logits.argmax(-1)
        for row, seq in enumerate(seqs):
            p = seq.spec.params
            if p.greedy:
                continue
            scores = logits[row].float() / p.temperature
            if p.top_k:
                kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            if p.top_p < 1.0:
                ordered, order = scores.sort(descending=True)
                probs = ordered.softmax(-1)
                drop = probs.cumsum(-1) - probs > p.top_p
                scores = scores.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
            tokens[row] = torch.multinomial(scores.softmax(-1), 1, generator=seq.generator)[0]
        return tokens
