"""The Hugging Face transformers engine, with continuous batching.

One scheduler thread owns the model. Each step drops every job that has ended and runs one
forward that feeds every running job's last token and the prompts of every job that has
arrived, which join the batch (their keys/values go into free rows of the preallocated KV
cache, worker/engines/kvcache.py): a job never waits for a whole batch to end before it starts,
nor costs the batch a forward of its own. Every token goes in with its row's own
`position_ids`, and the engine's attention reads the cache's layout (worker/engines/arch.py
checks at load that a joined row gets the logits it gets alone). Greedy decoding gives the same
tokens as `model.generate(do_sample=False)` in float32, which the tests check through the whole
queue.
How the pieces fit: docs/design.md, "The hf engine".
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from tasks.config import Settings
from tasks.schemas import GenerationResult, JobSpec, Logprobs
from worker import metrics
from worker.engines import arch, packed, prefix
from worker.engines.base import Engine, GenerationError, InvalidField, Sink
from worker.engines.dtype import resolve as resolve_dtype
from worker.engines.kvcache import ATTENTION, SlotKV
from worker.engines.logits import check
from worker.engines.output import OutputProcessor
from worker.engines.prefix import PrefixCache
from worker.engines.rows import Rows
from worker.engines.runner import ModelRunner
from worker.engines.scheduler import Admission, Scheduler, Seq

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


@dataclass
class StepStats:
    """What one step did, for the caller to record (worker/metrics.py)."""

    decoded: int = 0  # rows the decode step fed (0: none ran)
    preempted: int = 0
    queries: int = 0  # prompt tokens looked up in the prefix cache ...
    hits: int = 0  # ... and found there


@dataclass
class _Work:
    """What one step runs: the admitted jobs (they join), the partial ones (a chunk of their
    prompts), the rows that decode (the first ones, as the scheduler chose)."""

    admit: list[Seq]
    partial: list[Seq]
    stats: StepStats
    decode: list[Seq] = field(default_factory=list)


class HFEngine(Engine):
    name = "hf"

    def __init__(self, settings: Settings, sink: Sink | None = None):
        self.configure(settings, sink)
        # Background jobs (priority > 0: batch lines) may fill every row; a foreground job that
        # finds the batch full takes a background row's place (worker/engines/scheduler.py).
        # It reaches the engine through one of `reserved` Celery threads beyond the batch's
        # (the batch driver leaves them free of lines: webapp/batches.py).
        self.reserved = settings.reserved_slots if settings.reserved_slots is not None else self.capacity // 8
        hf_logging.disable_progress_bar()
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        log.info("torch threads: %d", torch.get_num_threads())
        self.tok = AutoTokenizer.from_pretrained(settings.model)
        device = resolve_device(settings.device)
        self.device = str(device)
        dtype, why = resolve_dtype(settings.dtype, gpu=device.type == "cuda")
        if dtype == "auto":  # on a GPU: bfloat16 where it computes it, else float16
            dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        log.info("weights in %s (%s) on %s", dtype, why, self.device)
        cfg = AutoConfig.from_pretrained(settings.model)
        self.max_model_len, notes = arch.prepare(cfg)  # raises for a model it cannot batch exactly
        for note in notes:
            log.info("%s: %s", cfg.model_type, note)
        self.eos = self.tok.eos_token_id if self.tok.eos_token_id is not None else cfg.eos_token_id
        self.scheduler = Scheduler(
            self.capacity,
            settings.background_step_every,
            prefill_budget=settings.max_prefill_tokens,
            prefill_share=settings.prefill_share,
            cached=lambda seq: self.runner.cached(seq),
            missing=lambda seq: self.runner.missing(seq),
        )
        self.output = OutputProcessor(self.tok, self.eos, self.model, self.max_model_len)
        self._cache_settings = (settings.prefix_cache_gib, settings.prefix_block_tokens, settings.kv_cache_gib)
        self._closed = threading.Event()
        # The model is loaded, checked and run on the engine's thread (`_start`); the engine is
        # ready, or its constructor raises, once that is done.
        self._started: Future[None] = Future()
        pack = settings.packed_linears and device.type == "cpu"  # oneDNN: a CPU path
        load = (settings.model, cfg, getattr(torch, dtype), device, pack)
        self._thread = threading.Thread(target=self._run, args=load, name="genq-scheduler", daemon=True)
        self._thread.start()
        self._started.result()

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    @property
    def eos(self) -> int | None:
        return self._eos

    @eos.setter
    def eos(self, token: int | None) -> None:
        """The token that ends a job (the tokenizer's EOS); the runner's min_tokens and the
        output processing follow it."""
        self._eos = token
        for part in (getattr(self, "runner", None), getattr(self, "output", None)):
            if part is not None:
                part.eos = token

    # -- called from Celery task threads ---------------------------------------------------

    def submit(self, spec: JobSpec) -> Future[GenerationResult]:
        if self._closed.is_set():
            raise GenerationError("engine_closed", "the engine is shutting down")
        ids = self._prompt_ids(spec)
        max_new = spec.params.max_new_tokens or self.default_max_new
        if self.max_model_len and len(ids) + max_new > self.max_model_len:
            raise GenerationError(
                "prompt_too_long",
                f"the prompt has {len(ids)} tokens; with max_new_tokens={max_new} that exceeds "
                f"the model's context of {self.max_model_len} tokens",
            )
        left, why = self.time_limit(spec)
        seq = Seq(
            spec,
            ids,
            max_new,
            self.scheduler.clock() + left,
            why,
            stop_ids=frozenset(spec.params.stop_token_ids),
            background=spec.priority > 0,
        )
        if spec.params.logprobs is not None:
            seq.lp, seq.lp_unsent = Logprobs(), Logprobs() if spec.stream else None
        if not spec.params.greedy:
            seq.generator = torch.Generator()
            if spec.params.seed is None:
                seq.generator.seed()
            else:
                seq.generator.manual_seed(spec.params.seed)
        self.scheduler.submit(seq)
        return seq.future

    def _prompt_ids(self, spec: JobSpec) -> list[int]:
        """The job's prompt as token ids: as it came (token ids), or tokenized (with the model's
        special tokens unless `add_special_tokens` is false or it is a chat prompt, whose
        template has them); its last `truncate_prompt_tokens` only. GenerationError
        invalid_request, naming the field, for what this model cannot take
        (worker/engines/logits.py: `check`)."""
        p, vocab = spec.params, self.runner.vocab
        if spec.prompt_token_ids is not None:
            ids = list(spec.prompt_token_ids)
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise GenerationError(
                    "invalid_request",
                    f"prompt: token id {bad[0]} is out of the vocabulary (0 to {vocab - 1})",
                    param="prompt",
                )
        else:
            add = p.add_special_tokens if p.add_special_tokens is not None else spec.chat is None
            ids = self.tok(spec.prompt, add_special_tokens=add).input_ids
        if p.truncate_prompt_tokens is not None:
            keep = self.max_model_len if p.truncate_prompt_tokens == -1 else p.truncate_prompt_tokens
            ids = ids[-keep:] if keep else ids
        try:
            check(p, self.tok, vocab)
        except ValueError as exc:  # InvalidField names the field; a tokenizer's own refusal does not
            field = exc.field if isinstance(exc, InvalidField) else None
            raise GenerationError("invalid_request", str(exc), param=field) from None
        return ids

    def cancel(self, job_id: str) -> None:
        self.scheduler.cancel(job_id)

    def close(self) -> None:
        self._closed.set()
        self.scheduler.wake()
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            # A closed engine holds no memory: its model, the batch's KV cache and the prefix
            # cache's pool go now, not when a garbage collection finds the engine (a process
            # that makes engines in turn, as the tests do, held every one's pool, and a fork
            # then failed for want of memory to commit).
            self.scheduler.rows = Rows()
            self.lm = self.prefix = None
            runner = getattr(self, "runner", None)
            if runner is not None:
                runner.lm = runner.kv = runner.scratch = runner.prefix = runner.next = runner.procs = None

    # -- the engine's thread ---------------------------------------------------------------

    def _start(self, model: str, cfg, dtype: torch.dtype, device: torch.device, pack: bool) -> bool:
        """Load the model, check it (worker/engines/arch.py) and pack its linear layers here,
        on the thread that runs every forward, so that no other thread of the process ever
        runs a parallel CPU op. Each thread that does gets its own OpenMP team: GNU OpenMP,
        counting more threads than cores, then stops spinning between ops, and each of a
        step's hundreds of small ops waits for its team to wake (a decode step of 64 rows took
        72 ms instead of 45 with the check run on the constructor's thread: docs/benchmarks.md,
        "One thread runs the model"; the earlier "Packed on the thread that runs them" was
        most likely the same effect)."""
        try:
            lm = AutoModelForCausalLM.from_pretrained(model, config=cfg, dtype=dtype, attn_implementation=ATTENTION)
            self.lm = lm.to(device).eval()
            arch.probe(self.lm)  # raises for a model it cannot batch exactly
            gib, block, kv_gib = self._cache_settings
            kv_budget = int((kv_gib if kv_gib is not None else prefix.memory(device) / 4 / (1 << 30)) * (1 << 30))
            kv = SlotKV.for_model(cfg, self.lm.dtype, self.capacity, device, budget=kv_budget)
            self.scheduler.kv_columns = kv.max_columns
            log.info("the batch's KV cache: at most %.2f GiB", kv_budget / (1 << 30))
            budget = prefix.default_budget(device) if gib is None else int(gib * (1 << 30))
            self.prefix = PrefixCache.for_kv(kv, budget, block) if budget else None
            self.caches_prefixes = self.prefix is not None
            log.info("prefix cache: %s", f"{budget / (1 << 30):.2f} GiB" if budget else "off")
            self.runner = ModelRunner(self.lm, kv, device, self.eos, tok=self.tok, prefix=self.prefix)
            self.scheduler.rows.follow(kv)  # the rows' order is the scheduler's (worker/engines/rows.py) ...
            self.scheduler.rows.follow(self.runner)  # ... and the runner's per-row state moves with them
            self.scheduler.chunk_block = self.runner.block if self.runner.prefix else 0  # chunks live in the cache
            if pack:
                log.info("linear layers: %s", packed.pack(self.lm))
        except BaseException as exc:  # the constructor raises it; this thread ends
            self._started.set_exception(exc)
            return False
        self._started.set_result(None)
        return True

    def _run(self, *load) -> None:
        if not self._start(*load):
            return
        with torch.inference_mode():
            while not self._closed.is_set():
                plan = self.scheduler.take()
                try:
                    stats = self.step(plan)
                except Exception as exc:  # a failed forward fails its batch, not the worker
                    log.exception("engine step failed")
                    self._fail_batch(plan.admit + plan.partial, GenerationError("engine_error", repr(exc)))
                    continue
                metrics.preempted(stats.preempted)
                metrics.prefix_cache(stats.queries, stats.hits)
                if stats.decoded:
                    metrics.decode_step(stats.decoded)
        for seq in self.scheduler.drain():
            if not seq.future.done():
                seq.future.set_exception(GenerationError("engine_closed", "the worker stopped"))

    def step(self, plan: Admission) -> StepStats:
        """schedule -> execute -> update, as vLLM's engine core: the rows that leave before the
        forward do, one forward decodes the running rows, prefills the admitted jobs and a
        chunk of the partial ones, and its tokens go out (rows whose jobs end leave)."""
        work = self._schedule(plan)
        if work.admit or work.decode or work.partial:
            looked = (self.prefix.queries, self.prefix.hits) if self.prefix else (0, 0)
            began = time.perf_counter()
            decoded, joined = self.runner.step(work.decode, work.admit, work.partial)
            self.scheduler.account(self.runner.chunk_s, time.perf_counter() - began)
            if self.prefix:
                work.stats.queries, work.stats.hits = self.prefix.queries - looked[0], self.prefix.hits - looked[1]
            self._update(work, decoded, joined)
        self._flush()
        return work.stats

    def _schedule(self, plan: Admission) -> _Work:
        """Before the forward: the preempted rows leave (their keys/values kept in the prefix
        cache), cancelled and expired jobs leave (running, admitted or partial), and the rows
        that decode this step are chosen."""
        rows = self.scheduler.rows
        work = _Work(list(plan.admit), list(plan.partial), StepStats(preempted=len(plan.preempt)))
        if plan.preempt:
            self._leave({rows[i] for i in plan.preempt})
        gone, keep = self.scheduler.reap(work.admit, work.partial)
        for seq, why in gone:
            self.output.fail(seq, why)
        if keep is not None:
            kept = set(keep)
            self._leave({s for i, s in enumerate(rows) if i not in kept})
        if rows:
            work.decode = rows[: self.scheduler.decode_rows()]
        return work

    def _update(self, work: _Work, decoded, joined) -> None:
        """After the forward: one new token for each row that decoded, the first token for each
        admitted job, whose row now follows the running ones; the partial jobs wait for their
        next chunk; the rows whose jobs ended leave."""
        for seq in work.partial:
            seq.prefilled, seq.chunk = seq.chunk, None
        self.scheduler.waiting[:0] = work.partial
        peak = len(work.decode) + len(work.admit)
        for seq in work.admit:
            seq.batch_peak = max(seq.batch_peak, peak)
        self.scheduler.rows.join(work.admit)
        (tokens, lps), (first, first_lps) = decoded, joined
        ended = {s for i, s in enumerate(work.decode) if not self.output.advance(s, tokens[i], lps.get(i))}
        ended |= {s for i, s in enumerate(work.admit) if not self.output.advance(s, first[i], first_lps.get(i))}
        self._leave(ended)
        work.stats.decoded = len(work.decode)

    def _leave(self, gone: set[Seq]) -> None:
        """The rows of the jobs in `gone` leave the batch; the prefix cache keeps what they computed."""
        if not gone:
            return
        for i, seq in enumerate(self.scheduler.rows):
            if seq in gone:
                self.runner.remember(i, seq)
        self.scheduler.rows.leave(gone)

    def _flush(self) -> None:
        events, resolved = self.output.take()
        if events or resolved:
            self.sink.emit(events, resolved)

    def _fail_batch(self, admitted: list[Seq], error: GenerationError) -> None:
        """After a failed step: the results already settled go out, every other job of the
        batch fails, and the batch starts empty."""
        _, resolved = self.output.take()
        for future, result in resolved:
            future.set_result(result)
        for seq in [*self.scheduler.rows, *admitted]:
            if not seq.future.done():
                seq.future.set_exception(error)
        self.scheduler.rows.keep([])
