"""The llama.cpp engine: a GGUF file served as it is, quantized, by llama.cpp's own kernels.

`GENQ_ENGINE=llamacpp GENQ_MODEL=path/to/model.gguf`. The hf engine's scheduling, output
processing and sampling are kept whole (it is an `HFEngine` with another runner): jobs join and
leave a running batch between steps, with the same admission, preemption, deadlines, stop
strings, logprobs, penalties, structured output and seeded sampling. Only the forward is
llama.cpp's: each step is one `llama_decode` of a batch holding every running row's next token
and the admitted jobs' prompts, each row a sequence of llama.cpp's KV cache (GENQ_KV_CACHE_GIB).
GENQ_LLAMACPP_KV=shared: one pool of cells the sequences share (a job waits while its prompt and
max_new_tokens would take the rows past it), where the prompt prefix that a running job holds,
or one that left, is shared, not computed again; split: a stream per sequence (a job's context is
its stream), whose tokens stay when its job leaves, for a later job that begins
with them (llama-server's slot reuse). Why an engine over llama.cpp and not quantized PyTorch
layers: docs/design.md, "Quantized models: the llamacpp engine".

Tokens are the GGUF's own vocabulary through the transformers tokenizer read from the same file
(worker/gguf.py `tokenizer_of`), so chat templates, tool calls and detokenising are the other
engines'. The library is the build scripts/llamacpp.py makes (worker/engines/llamacpp_lib.py).
"""

from __future__ import annotations

import ctypes
import heapq
import logging
import os
import threading
from concurrent.futures import Future

import numpy as np
import torch

from tasks.config import Settings
from worker.engines import llamacpp_lib
from worker.engines.base import GenerationError, Sink
from worker.engines.hf import HFEngine
from worker.engines.output import OutputProcessor
from worker.engines.rows import Rows
from worker.engines.runner import ModelRunner
from worker.engines.scheduler import Scheduler, Seq

log = logging.getLogger(__name__)

#: KV cache when GENQ_KV_CACHE_GIB is not set: 32,768 tokens of Qwen2.5-0.5B (its trained
#: context), small beside the weights (llama.cpp allocates and clears the whole cache at start).
DEFAULT_KV_GIB = 0.375
#: Tokens one llama_decode takes (n_batch; a step's longer batch is fed in several), and the
#: tokens llama.cpp computes at once inside one (n_ubatch).
BATCH, UBATCH = 2048, 512


def load_library():
    """llama-cpp-python's low-level bindings over this machine's build of llama.cpp."""
    lib = llamacpp_lib.lib_dir()
    if not (lib / "libllama.so").is_file():
        raise GenerationError(
            "no_engine",
            f"GENQ_ENGINE=llamacpp needs llama.cpp built for this CPU in {lib}: run `make llamacpp` "
            "(python -m scripts.llamacpp build)",
        )
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(lib))
    try:
        import llama_cpp.llama_cpp as ll
    except ImportError as exc:
        raise GenerationError("no_engine", f"GENQ_ENGINE=llamacpp needs llama-cpp-python: {exc}") from None
    return ll


class LlamaCpp:
    """One loaded GGUF model and its context: the KV cache of `seqs` sequences over `cells`,
    shared by them (`split` False: llama.cpp's unified cache), or a stream of `row_cells` each."""

    def __init__(self, path: str, seqs: int, kv_bytes: int, threads: int, split: bool = False):
        self.ll = ll = load_library()
        ll.llama_backend_init()
        ll.llama_log_set(_quiet, ctypes.c_void_p(0))
        mp = ll.llama_model_default_params()
        self.model = ll.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise GenerationError("no_engine", f"llama.cpp could not load {path}")
        self.vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.n_ctx_train = ll.llama_model_n_ctx_train(self.model)
        n_embd, n_head = ll.llama_model_n_embd(self.model), ll.llama_model_n_head(self.model)
        per_token = ll.llama_model_n_layer(self.model) * 2 * ll.llama_model_n_head_kv(self.model)
        per_token *= (n_embd // max(n_head, 1)) * 2  # keys and values, float16
        cells = max(256, min(kv_bytes // max(per_token, 1), self.n_ctx_train * seqs) // 256 * 256)
        if split:  # llama.cpp pads each stream to 256 cells: round down so the budget holds
            cells = max(256, min(cells // seqs, self.n_ctx_train) // 256 * 256) * seqs
        cp = ll.llama_context_default_params()
        cp.n_ctx = cells
        cp.n_batch = min(BATCH, cells)
        cp.n_ubatch = min(UBATCH, cells)
        cp.n_seq_max = seqs
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = not split
        cp.no_perf = True
        self.ctx = ll.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise GenerationError("no_engine", f"llama.cpp could not make a context of {cells} cells for {path}")
        self.cells = ll.llama_n_ctx(self.ctx)
        self.split = split
        self.row_cells = ll.llama_n_ctx_seq(self.ctx) if split else self.cells
        self.kv_bytes = self.cells * per_token
        self.memory = ll.llama_get_memory(self.ctx)
        self.n_batch = min(BATCH, self.cells)
        self.batch = ll.llama_batch_init(self.n_batch, 0, 1)

    def copy(self, src: int, dst: int, upto: int) -> None:
        """Sequence `dst` gets `src`'s first `upto` positions. In the shared cache this tags
        those cells with `dst` too (nothing is copied: both sequences attend to the same cells
        until one drops them); across split streams llama.cpp copies `src`'s whole stream at
        the next decode (`dst`'s own cells are dropped; the caller clears what is past `upto`)."""
        if self.split:
            self.ll.llama_memory_seq_cp(self.memory, src, dst, -1, -1)
        else:
            self.ll.llama_memory_seq_cp(self.memory, src, dst, 0, upto)

    def clear(self, seq: int, keep: int = 0) -> None:
        """Forget the sequence's cells from position `keep` on (0: all of them)."""
        if not self.ll.llama_memory_seq_rm(self.memory, seq, keep if keep else -1, -1):
            raise GenerationError("engine_error", f"llama.cpp could not drop sequence {seq}'s cells from {keep}")

    def decode(self, tokens: list[int], positions: list[int], seqs: list[int], logits: list[bool]) -> np.ndarray:
        """These tokens through the model (in llama_decode calls of at most n_batch tokens); the
        logits of those flagged, in order [n, vocab]."""
        out = []
        for at in range(0, len(tokens), self.n_batch):
            end = at + self.n_batch
            out.append(self._decode(tokens[at:end], positions[at:end], seqs[at:end], logits[at:end]))
        return out[0] if len(out) == 1 else np.concatenate(out)

    def _decode(self, tokens: list[int], positions: list[int], seqs: list[int], logits: list[bool]) -> np.ndarray:
        b, n = self.batch, len(tokens)
        np.ctypeslib.as_array(b.token, shape=(n,))[:] = tokens
        np.ctypeslib.as_array(b.pos, shape=(n,))[:] = positions
        np.ctypeslib.as_array(b.n_seq_id, shape=(n,))[:] = 1
        np.ctypeslib.as_array(b.logits, shape=(n,))[:] = logits
        for i, s in enumerate(seqs):
            b.seq_id[i][0] = s
        b.n_tokens = n
        rc = self.ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise GenerationError("engine_error", f"llama_decode returned {rc} for a batch of {n} tokens")
        kept = sum(logits)
        if not kept:
            return np.empty((0, self.vocab), dtype=np.float32)
        return np.ctypeslib.as_array(self.ll.llama_get_logits(self.ctx), shape=(kept, self.vocab)).copy()

    def close(self) -> None:
        ll = self.ll
        if self.ctx:
            ll.llama_batch_free(self.batch)
            ll.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            ll.llama_model_free(self.model)
            self.model = None


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet(level, text, user_data):
    """llama.cpp's log: warnings and errors to ours, the rest (per-tensor load lines) dropped."""
    if level in (3, 4):  # GGML_LOG_LEVEL_WARN, ERROR
        log.warning("llama.cpp: %s", text.decode(errors="replace").rstrip())


class LlamaCppRunner(ModelRunner):
    """The hf runner's step over llama.cpp: row i of the batch is llama.cpp sequence `sids[i]`,
    holding `pos[i]` tokens (`toks[i]`); the sampling, processors and logprobs are the base
    class's. A sequence whose job left keeps its tokens' keys/values (`kept`), and a job
    admitted starts from the longest prefix of its prompt that one of them holds, or in the
    shared cache a running row, and feeds the rest only (llama-server's slot reuse). In the
    shared cache, kept sequences' cells go, oldest first, where they and the rows' longest
    would overfill it (the scheduler bounds the rows alone by it).
    A job takes the lowest free sequence: one llama_decode computes rows of consecutive ids
    together (llama.cpp's `split_equal` over split streams), so the ids in use have few gaps."""

    def __init__(self, llm: LlamaCpp, seqs: int, eos: int | None, tok):
        self.llm, self.eos, self.tok = llm, eos, tok
        self.device = torch.device("cpu")
        self.prefix = self.scratch = None
        self.chunk_s, self.block = 0.0, 0
        self.vocab = llm.vocab
        self.next: torch.Tensor | None = None
        self.procs = None
        self.sids: list[int] = []
        self.pos: list[int] = []
        self.toks: list[list[int]] = []
        self.free = list(range(seqs))  # a heap: the lowest is taken first
        self.kept: dict[int, list[int]] = {}  # a free sequence's tokens still in the cache, oldest first
        self.hits = 0  # prompt tokens taken from sources

    def _take(self, seq: Seq, fed: list[int], active: int) -> tuple[int, int]:
        """The lowest free sequence for `seq`, and how many of `fed`'s first tokens it holds:
        the longest prefix of them that a source holds, copied in where it is another sequence.
        Sources: the free sequences' kept tokens and, in the shared cache, the first `active`
        rows' sequences, running (the chat template's system prompt is computed once for all
        the jobs that run together). Across split streams llama.cpp copies a whole stream's
        buffer, a few MiB, at the next decode; in the shared cache the new sequence shares the
        source's cells."""
        sid = heapq.heappop(self.free)
        src, have = sid, 0
        if not self._wants_prompt_logprobs(seq):
            sources = [(other, self.kept[other]) for other in (sid, *self.free) if other in self.kept]
            if not self.llm.split:
                sources += zip(self.sids[:active], self.toks[:active])
            for other, toks in sources:
                n = _common(toks, fed)
                if n > have:
                    src, have = other, n
            have = min(have, len(fed) - 1)  # the last token is fed: its logits are the next's
        if src != sid and not self.llm.split:
            self.llm.clear(sid)  # its own kept cells, at the positions the copy tags
        if have and src != sid:
            self.llm.copy(src, sid, have)
        self.llm.clear(sid, have)
        self.kept.pop(sid, None)
        return sid, have

    def step(self, running: list[Seq], admit: list[Seq], partial: list[Seq] = ()):
        if not (running or admit):
            return ([], {}), ([], {})
        active, before = len(running), len(self.sids)
        tokens = self.next[:active, 0].tolist() if active else []
        positions, seqs, flags = self.pos[:active], self.sids[:active], [True] * active
        fed = [s.fed for s in admit]
        self._evict([*running, *admit])
        new, skip = [], []
        last, spans = [], {}
        out = active
        for r, (seq, f) in enumerate(zip(admit, fed)):
            sid, have = self._take(seq, f, active)
            new.append(sid)
            skip.append(have)
            if not seq.looked:  # its first prefill: usage's cached_tokens
                seq.looked, seq.cached = True, have
            every = self._wants_prompt_logprobs(seq)
            tokens += f[have:]
            positions += range(have, len(f))
            seqs += [sid] * (len(f) - have)
            flags += [every] * (len(f) - have - 1) + [True]
            if every:
                spans[r] = out
                out += len(f)
            else:
                out += 1
            last.append(out - 1)
        try:
            logits = torch.from_numpy(self.llm.decode(tokens, positions, seqs, flags))
        except BaseException:
            for sid in new:
                self.llm.clear(sid)
                heapq.heappush(self.free, sid)
            raise
        self.hits += sum(skip)
        for i in range(active):
            self.pos[i] += 1
            self.toks[i].append(tokens[i])
        self.sids += new
        self.pos += [len(f) for f in fed]
        self.toks += [list(f) for f in fed]
        decoded = self._decoded(running, logits[:active], before) if active else ([], {})
        joined = self._joined(admit, fed, logits, last, spans, before) if admit else ([], {})
        return decoded, joined

    def _evict(self, rows: list[Seq]) -> None:
        """Shared cache: kept sequences' cells go, oldest first, while they and these rows'
        longest would take more cells than it has."""
        if self.llm.split or not self.kept:
            return
        over = sum(s.longest for s in rows) + sum(map(len, self.kept.values())) - self.llm.cells
        while over > 0 and self.kept:
            sid = next(iter(self.kept))
            over -= len(self.kept.pop(sid))
            self.llm.clear(sid)

    def remember(self, row: int, seq: Seq) -> None:
        """No prefix cache beyond the sources' (`_take`)."""

    def cached(self, seq: Seq) -> int:
        return 0

    def missing(self, seq: Seq):
        return None

    def move(self, order: list[int]) -> None:
        kept = set(order)
        for row, sid in enumerate(self.sids):
            if row not in kept:
                self.kept[sid] = self.toks[row]
                heapq.heappush(self.free, sid)
        self.sids = [self.sids[i] for i in order]
        self.pos = [self.pos[i] for i in order]
        self.toks = [self.toks[i] for i in order]
        super().move(order)

    def swap(self, a: list[int], b: list[int]) -> None:
        for x, y in zip(a, b, strict=True):
            self.sids[x], self.sids[y] = self.sids[y], self.sids[x]
            self.pos[x], self.pos[y] = self.pos[y], self.pos[x]
            self.toks[x], self.toks[y] = self.toks[y], self.toks[x]
        super().swap(a, b)


def _common(a, b) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class LlamaCppEngine(HFEngine):
    name = "llamacpp"

    def __init__(self, settings: Settings, sink: Sink | None = None):
        from transformers import AutoTokenizer

        from worker import gguf

        self.configure(settings, sink)
        self.reserved = settings.reserved_slots if settings.reserved_slots is not None else self.capacity // 8
        if not gguf.is_gguf(settings.model):
            raise GenerationError("no_engine", f"GENQ_ENGINE=llamacpp serves a .gguf file; GENQ_MODEL={settings.model}")
        self.path = str(os.path.abspath(os.path.expanduser(settings.model)))
        self.tok = AutoTokenizer.from_pretrained(gguf.tokenizer_of(self.path, settings.gguf_cache))
        self.threads = settings.torch_threads or os.cpu_count() or 1
        self.split = settings.llamacpp_kv == "split"
        # Sampling runs in torch on this process's other thread pool; one thread keeps it off
        # llama.cpp's cores (whose threads spin between a step's operations).
        torch.set_num_threads(1)
        self.device = "cpu"
        self.prefix = None
        self.caches_prefixes = False
        rows = self.capacity  # llama.cpp sequences: one a row
        self.scheduler = Scheduler(
            self.capacity,
            settings.background_step_every,
            prefill_budget=settings.max_prefill_tokens,
            prefill_share=settings.prefill_share,
        )
        gib = settings.kv_cache_gib if settings.kv_cache_gib is not None else DEFAULT_KV_GIB
        self._closed = threading.Event()
        self._started: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(rows, int(gib * (1 << 30))), name="genq-scheduler", daemon=True
        )
        self._thread.start()
        self._started.result()

    def _start(self, rows: int, kv_bytes: int) -> bool:
        """Load the model and make its context on the thread that runs every decode."""
        try:
            self.llm = LlamaCpp(self.path, rows, kv_bytes, self.threads, self.split)
            # A job's context: the model's, and its stream (split) or the whole cache (shared),
            # which the running rows share: then a job waits while they would overfill it.
            self.max_model_len = min(self.llm.n_ctx_train, self.llm.row_cells)
            self.scheduler.kv_cells = 0 if self.split else self.llm.cells
            self.runner = LlamaCppRunner(self.llm, rows, None, self.tok)
            self.scheduler.rows.follow(self.runner)
            self.output = OutputProcessor(self.tok, None, self.model, self.max_model_len)
            self.eos = self.tok.eos_token_id  # the runner's and the output's
            log.info(
                "llama.cpp: %s, KV cache of %d tokens (%.2f GiB) %s %d jobs, %d threads",
                os.path.basename(self.path),
                self.llm.cells,
                self.llm.kv_bytes / (1 << 30),
                f"in streams of {self.llm.row_cells} for up to" if self.split else "shared by up to",
                rows,
                self.threads,
            )
        except BaseException as exc:
            self._started.set_exception(exc)
            return False
        self._started.set_result(None)
        return True

    def close(self) -> None:
        super().close()
        if not self._thread.is_alive() and getattr(self, "llm", None) is not None:
            self.scheduler.rows = Rows()
            self.llm.close()
            self.llm = None
