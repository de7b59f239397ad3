"""The Hugging Face transformers engine, with continuous batching.

One scheduler thread owns the model. Between two decode steps it admits every job that has
arrived (one left-padded prefill for all of them, whose keys/values are then copied into free
rows of the batch's preallocated KV cache, worker/engines/kvcache.py) and drops every job that
has finished, been cancelled or run out of time, so a job never waits for a whole batch to
end before it starts. Each decode step feeds every running job's last token at once, with each
row's own position (`position_ids`: the tokens it has fed so far), so the left padding that
joins sequences of different lengths, and the columns of a row that joined late or sat a step
out, are invisible to the model; worker/engines/arch.py checks at load that the architecture
honours them, and refuses one that cannot be batched exactly. Columns that every row pads leave
the cache's window whenever rows leave. A decode step writes the new keys/values in place:
nothing but the matmuls grows with the batch's length.

Greedy decoding here gives the same tokens as `model.generate(do_sample=False)` on the same
prompt, which the tests check through the whole queue. vLLM's penalties, `min_tokens` and
log-probabilities are tensor operations over the whole batch in each step (worker/engines/
logits.py), skipped entirely while no job in the batch asks for them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.utils import logging as hf_logging

from tasks.config import Settings
from tasks.schemas import GenerationResult, JobSpec, Logprobs
from tasks.streams import TokenEvent
from worker import metrics
from worker.engines import arch, packed
from worker.engines.base import DirectSink, Engine, GenerationError, JobCancelled, Resolved, Sink
from worker.engines.dtype import resolve as resolve_dtype
from worker.engines.kvcache import SlotKV
from worker.engines.logits import RowProcessors, logprobs, sample

log = logging.getLogger(__name__)


def resolve_device(setting: str) -> torch.device:
    """GENQ_DEVICE as a torch device: auto is CUDA (the current GPU) when torch sees one."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(setting)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise GenerationError("no_device", f"GENQ_DEVICE={setting}, but torch sees no CUDA device")
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise GenerationError("no_device", f"GENQ_DEVICE={setting}: torch sees {torch.cuda.device_count()} GPUs")
        device = torch.device("cuda", index)
    return device


@dataclass(eq=False)
class _Seq:
    spec: JobSpec
    prompt_ids: list[int]
    max_new: int
    deadline: float  # time.monotonic(): the job's own deadline or the worker's ceiling
    timeout_message: str
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
    stop_ids: frozenset[int] = frozenset()  # tokens that end the job, as EOS does
    # With the `logprobs` parameter: every token's so far (`lp`), those not yet streamed
    # (`lp_unsent`), and the characters the tokens so far take (`lp_offset`).
    lp: Logprobs | None = None
    lp_unsent: Logprobs | None = None
    lp_offset: int = 0
    # A background job (priority > 0: batch lines) sits decode steps out while foreground jobs
    # run (HFEngine._decode), and gives its row up to one that finds the batch full
    # (HFEngine._preempt).
    background: bool = False

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
        # Background jobs (priority > 0: batch lines) may fill every row. A foreground job
        # that finds the batch full takes a background row's place at once (`_preempt`): an
        # interactive request does not wait for a batch line to finish. It reaches the engine
        # through one of `reserved` Celery threads beyond the batch's (the batch driver leaves
        # them free of lines: webapp/batches.py).
        self.capacity = settings.max_batch_size
        self.reserved = settings.reserved_slots if settings.reserved_slots is not None else self.capacity // 8
        self.preemptions = 0
        self.background_every = settings.background_step_every
        self.default_max_new = settings.default_max_new_tokens
        self.job_timeout = settings.job_timeout
        hf_logging.disable_progress_bar()
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        log.info("torch threads: %d", torch.get_num_threads())
        self.tok = AutoTokenizer.from_pretrained(settings.model)
        self._device = resolve_device(settings.device)
        self.device = str(self._device)
        dtype, why = resolve_dtype(settings.dtype, gpu=self._device.type == "cuda")
        if dtype == "auto":  # on a GPU: bfloat16 where it computes it, else float16
            dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        log.info("weights in %s (%s) on %s", dtype, why, self.device)
        cfg = AutoConfig.from_pretrained(settings.model)
        self.max_model_len, notes = arch.prepare(cfg)  # raises for a model it cannot batch exactly
        for note in notes:
            log.info("%s: %s", cfg.model_type, note)
        self.lm = AutoModelForCausalLM.from_pretrained(settings.model, config=cfg, dtype=getattr(torch, dtype))
        self.lm = self.lm.to(self._device).eval()
        self.eos = self.tok.eos_token_id if self.tok.eos_token_id is not None else cfg.eos_token_id
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos
        arch.probe(self.lm, self.pad)

        self._inbox: queue.SimpleQueue[_Seq | None] = queue.SimpleQueue()
        # Jobs taken from the inbox that found no room yet (background ones at their limit).
        self._waiting: list[_Seq] = []
        self._events: list[tuple[str, TokenEvent]] = []
        self._resolved: list[Resolved] = []
        self._cancel_lock = threading.Lock()
        self._cancelled: set[str] = set()
        self._closed = threading.Event()
        # The running batch: one row per sequence. The KV cache and its attention mask (written
        # in place, worker/engines/kvcache.py) cover every token fed so far; `_next` holds each
        # row's newest token, which the next step feeds.
        self._seqs: list[_Seq] = []
        self._kv = SlotKV.for_model(cfg, self.lm.dtype, self.capacity, self._device)
        self._next: torch.Tensor | None = None
        # The batch's logits processors (None while no row needs any) and the rows that want
        # log-probabilities, both in step with `_seqs`.
        self._procs: RowProcessors | None = None
        self._lp_rows: list[int] = []
        # Foreground rows come first: `_fg` of them (`_partition`); decode steps counted for
        # the background's turn.
        self._fg = 0
        self._steps = 0
        self._pieces: dict[int, str] = {}
        # The linears are packed on the thread that will run them (`_start`); the engine is
        # ready, or its constructor raises, once that is done.
        self._started: Future[None] = Future()
        pack = settings.packed_linears and self._device.type == "cpu"  # oneDNN: a CPU path
        self._thread = threading.Thread(target=self._run, args=(pack,), name="genq-scheduler", daemon=True)
        self._thread.start()
        self._started.result()

    # -- called from Celery task threads ---------------------------------------------------

    def submit(self, spec: JobSpec) -> Future[GenerationResult]:
        if self._closed.is_set():
            raise GenerationError("engine_closed", "the engine is shutting down")
        ids = self.tok(spec.prompt, add_special_tokens=spec.chat is None).input_ids  # chat: in the template
        max_new = spec.params.max_new_tokens or self.default_max_new
        if self.max_model_len and len(ids) + max_new > self.max_model_len:
            raise GenerationError(
                "prompt_too_long",
                f"the prompt has {len(ids)} tokens; with max_new_tokens={max_new} that exceeds "
                f"the model's context of {self.max_model_len} tokens",
            )
        left, why = self.time_limit(spec)
        seq = _Seq(spec, ids, max_new, time.monotonic() + left, why, stop_ids=frozenset(spec.params.stop_token_ids),
                   background=spec.priority > 0)
        if spec.params.logprobs is not None:
            seq.lp, seq.lp_unsent = Logprobs(), Logprobs() if spec.stream else None
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

    def _start(self, pack: bool) -> bool:
        """Pack the linear layers here, on the thread that runs every forward: oneDNN
        linears packed on another thread (the constructor's) ran a decode step on ~1.4 of 2
        cores and 1.1-1.4x slower (docs/benchmarks.md, "Packed on the thread that runs
        them"); PyTorch's own linears did not care which thread loaded them."""
        try:
            if pack:
                log.info("linear layers: %s", packed.pack(self.lm))
        except BaseException as exc:  # the constructor raises it; this thread ends
            self._started.set_exception(exc)
            return False
        self._started.set_result(None)
        return True

    def _run(self, pack: bool = False) -> None:
        if not self._start(pack):
            return
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
        for seq in self._seqs + self._waiting:
            seq.future.set_exception(GenerationError("engine_closed", "the worker stopped"))
        while True:
            try:
                seq = self._inbox.get_nowait()
            except queue.Empty:
                return
            if seq is not None:
                seq.future.set_exception(GenerationError("engine_closed", "the worker stopped"))

    def _take(self) -> list[_Seq]:
        """Jobs to admit now, foreground ones first, as many as there are free rows; foreground
        jobs that find no free row take those of background rows (`_preempt`). The rest wait
        for the next step, preempted rows first among the background. Blocks (briefly) only
        while nothing runs or waits."""
        pending, self._waiting = self._waiting, []
        if not self._seqs and not pending:
            try:
                item = self._inbox.get(timeout=0.5)
            except queue.Empty:
                return []
            if item is None:
                return []
            pending.append(item)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is None:
                break
            pending.append(item)
        room = self.capacity - len(self._seqs)
        short = sum(not s.background for s in pending) - room
        if short > 0 and self._fg < len(self._seqs):
            pending[:0] = self._preempt(short)
            room = self.capacity - len(self._seqs)
        new: list[_Seq] = []
        for seq in sorted(pending, key=lambda s: s.background):
            if room > 0:
                new.append(seq)
                room -= 1
            else:
                self._waiting.append(seq)
        return new

    def _preempt(self, n: int) -> list[_Seq]:
        """Take up to `n` background rows out of the batch, those cheapest to take up again (the
        fewest tokens of prompt and output). They keep their tokens, text and sampling state;
        `_admit` prefills their prompt and tokens so far when a row frees, and they go on
        where they were (preemption by recompute, as vLLM's)."""
        rows = range(self._fg, len(self._seqs))
        out = set(sorted(rows, key=lambda i: len(self._seqs[i].prompt_ids) + len(self._seqs[i].out))[:n])
        taken = [self._seqs[i] for i in sorted(out)]
        self._select([i for i in range(len(self._seqs)) if i not in out])
        self.preemptions += len(taken)
        metrics.preempted(len(taken))
        return taken

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
        """Fail cancelled jobs and jobs past their deadline, running or just arrived; the
        latter keep what they generated as a partial result."""
        with self._cancel_lock:
            cancelled, self._cancelled = self._cancelled, set()
        now = time.monotonic()

        def gone(seq: _Seq) -> bool:
            if seq.spec.id in cancelled:
                seq.future.set_exception(JobCancelled(seq.spec.id))
                return True
            if now > seq.deadline:
                partial = self._result(seq, "timeout", self.tok.decode(seq.out, skip_special_tokens=True))
                seq.future.set_exception(GenerationError("timeout", seq.timeout_message, partial))
                return True
            return False

        new[:] = [s for s in new if not gone(s)]
        self._waiting = [s for s in self._waiting if not gone(s)]
        if self._seqs:
            keep = [i for i, s in enumerate(self._seqs) if not gone(s)]
            if len(keep) < len(self._seqs):
                self._select(keep)

    def _admit(self, new: list[_Seq]) -> None:
        """Prefill the new jobs together and join them to the running batch. A preempted job
        is prefilled with its prompt and the tokens it had: its next token comes out."""
        fed = [s.prompt_ids + s.out for s in new]
        width = max(map(len, fed))
        ids = torch.full((len(new), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(new), width), dtype=torch.long)
        for row, tokens in enumerate(fed):
            n = len(tokens)
            ids[row, width - n :] = torch.tensor(tokens)
            mask[row, width - n :] = 1
        # Each row's own positions, whatever its left padding (OPT derives them from the mask;
        # most architectures would otherwise number every row's columns from 0 alike).
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, positions = (t.to(self._device) for t in (ids, mask, positions))
        out = self.lm(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        raw = out.logits[:, -1, :]
        procs = RowProcessors.build(
            [s.spec.params for s in new], fed,
            [min(s.spec.params.min_tokens, s.max_new) for s in new], self.eos, raw.shape[-1],
            outputs=[s.out for s in new],
        )  # fmt: skip
        first = self._choose(new, raw, procs)
        lps = self._logprobs(new, raw, first, [i for i, s in enumerate(new) if s.lp is not None])
        base = len(self._seqs)
        self._procs = RowProcessors.join(self._procs, procs, base, len(new), raw.shape[-1])
        self._join(new, out.past_key_values, mask, first.view(-1, 1).to(self._device))
        self._lp_rows = [i for i, s in enumerate(self._seqs) if s.lp is not None]
        self._settle(first.tolist(), offset=base, lps=lps)
        self._partition()

    def _join(self, new: list[_Seq], cache: DynamicCache, mask: torch.Tensor, nxt) -> None:
        """Add the prefilled rows to the batch: only their own keys/values are copied."""
        self._kv.append(cache, mask)
        self._next = nxt if self._next is None else torch.cat([self._next, nxt])
        self._seqs.extend(new)

    def _decode(self) -> None:
        """One decode step. While foreground jobs run beside background ones, only the
        foreground rows (the first `_fg`) step, except on one step in `background_every`: a
        batch of 32 steps ~3x slower than a batch of 1 on a CPU, so an interactive request
        beside a large batch would otherwise take ~3x as long as alone. Sitting a step out
        costs a background row nothing but time (a masked cache column)."""
        rows = len(self._seqs)
        self._steps += 1
        batch = rows
        if 0 < self._fg < rows and self._steps % self.background_every:
            batch = self._fg
        for seq in self._seqs[:batch]:
            seq.batch_peak = max(seq.batch_peak, batch)
        metrics.decode_step(batch)
        out = self.lm(
            input_ids=self._next[:batch],
            position_ids=self._kv.positions(batch),
            attention_mask=self._kv.step_mask(batch),
            past_key_values=self._kv.cache,
            use_cache=True,
        )
        self._kv.advance()
        raw = out.logits[:, -1, :]
        seqs = self._seqs[:batch]
        procs = self._procs if batch == rows or self._procs is None else self._procs.head(batch)
        tokens = self._choose(seqs, raw, procs)
        lps = self._logprobs(seqs, raw, tokens, [r for r in self._lp_rows if r < batch])
        if batch == rows:
            self._next = tokens.view(-1, 1).to(self._device)
        else:
            self._next[:batch, 0] = tokens.to(self._device)
        self._settle(tokens.tolist(), lps=lps)

    def _choose(self, seqs: list[_Seq], raw: torch.Tensor, procs: RowProcessors | None) -> torch.Tensor:
        """Each row's next token, on the CPU: from the raw logits, or the processed ones where a
        row of the batch asked for penalties or min_tokens. Sampling, the processors and the
        seeded generators stay on the CPU whatever the model's device (the same draws for a
        seed on every device); a greedy batch copies only its tokens back from a GPU."""
        if procs is None and raw.device.type != "cpu" and all(s.spec.params.greedy for s in seqs):
            return raw.argmax(-1).cpu()
        raw = raw.cpu()
        if procs is None:
            return self._sample(seqs, raw)
        tokens = self._sample(seqs, procs.apply(raw))
        procs.update(tokens)
        return tokens

    def _logprobs(self, seqs: list[_Seq], raw: torch.Tensor, tokens: torch.Tensor, rows: list[int]) -> dict:
        """row -> (the chosen token's log-probability, the row's top ones) for `rows`."""
        if not rows:
            return {}
        top = [seqs[i].spec.params.logprobs for i in rows]
        return dict(zip(rows, logprobs(raw.cpu(), tokens, rows, top)))

    def _piece(self, token: int) -> str:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.tok.decode([token])
        return piece

    def _settle(self, tokens: list[int], offset: int = 0, lps: dict | None = None) -> None:
        """Record one new token for each row from `offset` on, as many as `tokens` (the rows
        after them sat the step out); drop the rows that finished. `lps`: the
        log-probabilities of rows that want them (by row)."""
        keep = list(range(offset))
        for i, token in enumerate(tokens, start=offset):
            lp = lps.get(i - offset) if lps else None
            if self._advance(self._seqs[i], token, lp):
                keep.append(i)
        keep += range(offset + len(tokens), len(self._seqs))
        if len(keep) < len(self._seqs):
            self._select(keep)

    def _partition(self) -> None:
        """Put the foreground rows first (swapping misplaced rows pairwise: only those rows'
        cache is copied), so that a step can feed them alone."""
        fg = [i for i, s in enumerate(self._seqs) if not s.background]
        self._fg = len(fg)
        late = [i for i in fg if i >= self._fg]
        if not late:
            return
        early = [i for i in range(self._fg) if self._seqs[i].background]
        self._kv.swap(late, early)
        order = list(range(len(self._seqs)))
        for a, b in zip(late, early):
            order[a], order[b] = b, a
        self._reorder(order)

    def _reorder(self, order: list[int]) -> None:
        """The per-row state follows the cache's rows: row i is now old row order[i]."""
        idx = torch.tensor(order)
        if self._procs is not None:
            self._procs = self._procs.select(idx)
        self._next = self._next.index_select(0, idx.to(self._device))
        self._seqs = [self._seqs[i] for i in order]
        self._lp_rows = [i for i, s in enumerate(self._seqs) if s.lp is not None]

    def _advance(self, seq: _Seq, token: int, lp: tuple | None = None) -> bool:
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

    def _add_logprob(self, seq: _Seq, token: int, chosen: float, top: list[tuple[int, float]]) -> None:
        piece = self._piece(token)
        alternatives = {self._piece(t): v for t, v in top}
        alternatives.setdefault(piece, chosen)
        for lp in (seq.lp, seq.lp_unsent) if seq.lp_unsent is not None else (seq.lp,):
            lp.tokens.append(piece)
            lp.token_logprobs.append(chosen)
            lp.top_logprobs.append(alternatives)
            lp.text_offset.append(seq.lp_offset)
        seq.lp_offset += len(piece)

    def _stream(self, seq: _Seq, text: str, **final) -> None:
        if seq.spec.stream:
            lp = None
            if seq.lp_unsent is not None and seq.lp_unsent.tokens:
                lp, seq.lp_unsent = seq.lp_unsent.model_dump(), Logprobs()
            self._events.append((seq.spec.id, TokenEvent(seq.events, text, **final, logprobs=lp)))
        seq.events += 1

    def _result(self, seq: _Seq, reason: str, text: str) -> GenerationResult:
        return GenerationResult(
            text=text,
            finish_reason=reason,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.out),
            batch_size=max(seq.batch_peak, 1),
            model=self.model,
            logprobs=seq.lp,
        )

    def _resolve(self, seq: _Seq, reason: str, text: str | None = None) -> bool:
        if text is None:
            text = self.tok.decode(seq.out, skip_special_tokens=True)
        result = self._result(seq, reason, text)
        usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens}
        self._stream(seq, text[seq.sent :], finish=reason, usage=usage)
        self._resolved.append((seq.future, result))
        return False

    def _select(self, keep: list[int]) -> None:
        """Keep only the rows in `keep` (ascending). The KV cache moves its last rows into the
        holes and trims padding that no remaining row needs; the per-row state follows the rows'
        new order."""
        order = self._kv.select(keep)
        if not keep:
            self._seqs, self._next = [], None
            self._procs, self._lp_rows, self._fg = None, [], 0
            return
        self._reorder(order)
        self._partition()

    @staticmethod
    def _sample(seqs: list[_Seq], logits: torch.Tensor) -> torch.Tensor:
        return sample(logits, [s.spec.params for s in seqs], [s.generator for s in seqs])
