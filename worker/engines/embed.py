"""The embed engine: a sentence-embedding checkpoint (a sentence-transformers folder) served
through sentence-transformers' own `SentenceTransformer`, whose modules (the encoder, the
pooling its config names: mean, CLS, last token; Normalize) make each input's vector.

Each job (one /v1/embeddings request, or batch line) carries many inputs. The Celery task
threads tokenize their job's inputs and check them (length, token ids, `dimensions`), then
hand them to one scheduler thread. That thread takes the inputs of the oldest jobs waiting
(about two forwards' worth), sorts them by length and runs them in forwards of at most
GENQ_EMBED_BATCH_TOKENS tokens, so that many small requests share forwards as one big batch
would. A job's result, its vectors as base64 float32, is set once its last input is done.

On a CPU the scheduler thread packs the linear layers for oneDNN (worker/engines/packed.py,
as the hf engine does) and, where the model allows, runs forwards without padding
(worker/engines/varlen.py): the budget then counts the inputs' tokens, else rows x the
longest. `GENQ_DTYPE=auto` is bfloat16 on CPUs that compute it natively (dtype.py).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from tasks.config import Settings
from tasks.schemas import GenerationResult, JobSpec
from worker.engines import dtype as dtypes
from worker.engines import varlen
from worker.engines.base import Engine, GenerationError, JobCancelled

log = logging.getLogger(__name__)


def matryoshka_dims(model_dir: str) -> list[int] | None:
    """The dimensions the model's vectors may be cut to, as its config.json says (vLLM reads the
    same keys): None, none (not a Matryoshka model); [], any; else those listed."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims:
        return sorted(int(d) for d in dims)
    return [] if config.get("is_matryoshka") else None


# Inputs a packed forward must embed as the padded one does before the engine uses it: short
# and long, repeated lengths (a run of equal lengths is one attention call).
SAMPLE = ["hi", "x", "A queue of jobs.", "A queue of jobs!", "Served by long-lived workers, " * 3] + [
    " ".join(["word"] * n) for n in (5, 9, 9, 17, 40)
]


@dataclass(eq=False)
class _Job:
    spec: JobSpec
    future: Future
    ids: list[list[int]]
    deadline: float  # monotonic
    why: str  # what its timeout error says
    vectors: list = field(default_factory=list)
    left: int = 0
    batch_size: int = 0
    done: bool = False


class EmbedEngine(Engine):
    name = "embed"
    task = "embed"

    def __init__(self, settings: Settings):
        import torch
        from sentence_transformers import SentenceTransformer

        self.torch = torch
        self.configure(settings, None)
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        device = settings.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        name, why = dtypes.resolve(settings.dtype, gpu=device != "cpu")
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)
        log.info("dtype %s (%s)", str(dtype).removeprefix("torch."), why)
        self.st = SentenceTransformer(settings.model, device=device, local_files_only=True)
        if dtype is not torch.float32:
            self.st.to(dtype)
        self.st.eval()
        self.tok = self.st.tokenizer
        if self.tok.pad_token is None:  # a decoder's tokenizer: pad with EOS (masked out)
            self.tok.pad_token = self.tok.eos_token
        self.max_model_len = int(self.st.max_seq_length)
        self.dimension = int(self.st.get_embedding_dimension())
        self.matryoshka = matryoshka_dims(settings.model)
        self.vocab = len(self.tok)
        self.budget = settings.embed_batch_tokens
        self._pack_linears = settings.packed_linears and device == "cpu"
        self._packer: varlen.Packer | None = None  # set by the scheduler thread where it can
        self._cond = threading.Condition()
        self._waiting: list[_Job] = []
        self._jobs: dict[str, _Job] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="genq-embed", daemon=True)
        self._ready = threading.Event()
        self._thread.start()
        self._ready.wait()
        log.info(
            "embedding model: %d dimensions, inputs of at most %d tokens, Matryoshka %s",
            self.dimension,
            self.max_model_len,
            "no" if self.matryoshka is None else (self.matryoshka or "any"),
        )

    # -- the task threads' side --------------------------------------------------------------

    def submit(self, spec: JobSpec) -> Future[GenerationResult]:
        if spec.embed is None:
            raise GenerationError(
                "invalid_request",
                f"model {self.model!r} serves embeddings (POST /v1/embeddings), not completions",
                param="model",
            )
        self.check_dimensions(spec.embed.dimensions)
        ids = self.tokenize(spec.embed.inputs, spec.embed.truncate_prompt_tokens)
        future: Future[GenerationResult] = Future()
        limit, why = self.time_limit(spec)
        job = _Job(spec, future, ids, time.monotonic() + limit, why, [None] * len(ids), len(ids))
        with self._cond:
            if self._closed:
                raise GenerationError("engine_error", "the engine is shutting down")
            self._jobs[spec.id] = job
            self._waiting.append(job)
            self._cond.notify()
        return future

    def check_dimensions(self, dims: int | None) -> None:
        if dims is None:
            return
        if self.matryoshka is None:
            raise GenerationError(
                "invalid_request",
                f"dimensions: model {self.model!r} does not support cutting its vectors (it is not a Matryoshka "
                f"model); leave dimensions out for its {self.dimension}",
                param="dimensions",
            )
        if dims > self.dimension or (self.matryoshka and dims not in self.matryoshka):
            allowed = self.matryoshka or f"1 to {self.dimension}"
            raise GenerationError(
                "invalid_request", f"dimensions: {dims}; model {self.model!r} takes {allowed}", param="dimensions"
            )

    def tokenize(self, inputs: list[str | list[int]], truncate: int | None) -> list[list[int]]:
        """Each input's token ids: texts with the model's special tokens (as sentence-transformers
        tokenizes), token ids as they are; cut to `truncate` tokens (-1: the model's limit) on
        the side the tokenizer cuts, else refused when longer than the model takes."""
        most = self.max_model_len
        if truncate is not None and truncate != -1 and truncate > most:
            raise GenerationError(
                "invalid_request",
                f"truncate_prompt_tokens: {truncate} is more than the model's limit of {most} tokens",
                param="truncate_prompt_tokens",
            )
        keep = None if truncate is None else (most if truncate == -1 else truncate)
        texts = [(i, t) for i, t in enumerate(inputs) if isinstance(t, str)]
        out: list[list[int]] = [t if isinstance(t, list) else [] for t in inputs]
        if texts:
            kw = {"truncation": True, "max_length": keep} if keep is not None else {"truncation": False}
            enc = self.tok([t for _, t in texts], add_special_tokens=True, verbose=False, **kw)["input_ids"]
            for (i, _), ids in zip(texts, enc, strict=True):
                out[i] = list(ids)
        left = self.tok.truncation_side == "left"
        for i, ids in enumerate(out):
            if not ids:
                raise GenerationError("invalid_request", f"input[{i}]: no tokens", param="input")
            if isinstance(inputs[i], list):
                bad = next((t for t in ids if not 0 <= t < self.vocab), None)
                if bad is not None:
                    raise GenerationError(
                        "invalid_request",
                        f"input[{i}]: token id {bad} is not in the model's vocabulary (0 to {self.vocab - 1})",
                        param="input",
                    )
                if keep is not None and len(ids) > keep:
                    out[i] = ids = ids[-keep:] if left else ids[:keep]
            if len(ids) > most:
                raise GenerationError(
                    "prompt_too_long",
                    f"input[{i}] has {len(ids)} tokens; the model takes at most {most} (send "
                    f"truncate_prompt_tokens to cut longer inputs)",
                    param="input",
                )
        return out

    def cancel(self, job_id: str) -> None:
        with self._cond:
            job = self._jobs.get(job_id)
            if job is not None:
                self._end(job, JobCancelled())

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for job in list(self._jobs.values()):
                self._end(job, GenerationError("engine_error", "the engine shut down"))
            self._cond.notify_all()
        self._thread.join(timeout=10)

    # -- the scheduler thread ----------------------------------------------------------------

    def _end(self, job: _Job, outcome: GenerationResult | BaseException) -> None:
        """Resolve a job once (under the lock)."""
        if job.done:
            return
        job.done = True
        self._jobs.pop(job.spec.id, None)
        if isinstance(outcome, BaseException):
            job.future.set_exception(outcome)
        else:
            job.future.set_result(outcome)

    def _prepare(self) -> None:
        """On the thread that runs the model (packed weights are fastest used where packed;
        packed.pack): the linear layers packed, and the forward without padding where the
        model gives the same vectors that way."""
        encoder = varlen.encoder(self.st)
        if self._pack_linears and encoder is not None:
            from worker.engines import packed

            log.info("linear layers: %s", packed.pack(encoder))
        sample = self.tokenize(SAMPLE, -1)
        sample.sort(key=len)
        with self.torch.inference_mode():
            self._packer, why = varlen.Packer.install(
                self.st, self.tok.pad_token_id, self._padded, sample, self.max_model_len
            )
        log.info("forwards: %s", why)

    def _loop(self) -> None:
        try:
            self._prepare()
        except Exception:  # noqa: BLE001 - the padded forward of the model as loaded still serves
            log.exception("preparing the model's forward failed; it runs as loaded")
        finally:
            self._ready.set()
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                jobs = self._take()
            items = sorted(((job, i) for job in jobs for i in range(len(job.ids))), key=lambda x: len(x[0].ids[x[1]]))
            for chunk in self._chunks(items):
                now = time.monotonic()
                with self._cond:
                    for job in {job for job, _ in chunk}:
                        if not job.done and now > job.deadline:
                            self._end(job, GenerationError("timeout", job.why))
                    chunk = [(job, i) for job, i in chunk if not job.done]
                if not chunk:
                    continue
                try:
                    vectors = self._forward([job.ids[i] for job, i in chunk])
                except Exception as exc:  # noqa: BLE001 - the chunk's jobs fail, the engine goes on
                    log.exception("embedding forward failed")
                    with self._cond:
                        for job in {job for job, _ in chunk}:
                            self._end(job, GenerationError("engine_error", f"{type(exc).__name__}: {exc}"))
                    continue
                finished = []
                for (job, i), vec in zip(chunk, vectors, strict=True):
                    job.vectors[i] = vec
                    job.left -= 1
                    job.batch_size = max(job.batch_size, len(chunk))
                    if job.left == 0:
                        finished.append(job)
                for job in finished:
                    result = self._result(job)
                    with self._cond:
                        self._end(job, result)

    def _take(self) -> list[_Job]:
        """The next jobs to run (under the lock): the oldest waiting, as many as fill about
        two forwards (at least one job). Jobs then end a forward or two after they are taken,
        instead of all at the end of one long pass, and the rest (with any that arrive
        meanwhile) go into the next pass, sorted together: the engine stays busy while the
        clients of the ended jobs send their next requests."""
        taken, tokens = 0, 0
        for job in self._waiting:
            if taken and tokens >= 2 * self.budget:
                break
            taken += 1
            tokens += sum(len(ids) for ids in job.ids)
        jobs, self._waiting = self._waiting[:taken], self._waiting[taken:]
        return jobs

    def _chunks(self, items: list[tuple[_Job, int]]):
        """Runs of `items` (sorted by length) whose size fits the token budget: their tokens
        (packed forwards), else rows x the longest (padded)."""
        chunk: list[tuple[_Job, int]] = []
        tokens = 0
        for item in items:
            n = len(item[0].ids[item[1]])
            size = tokens + n if self._packer is not None else (len(chunk) + 1) * n
            if chunk and size > self.budget:
                yield chunk
                chunk, tokens = [], 0
            chunk.append(item)
            tokens += n
        if chunk:
            yield chunk

    def _forward(self, rows: list[list[int]]):
        """The vectors of `rows` (sorted by length, shortest first)."""
        with self.torch.inference_mode():
            return self._packer(rows) if self._packer is not None else self._padded(rows)

    def _padded(self, rows: list[list[int]]):
        features = self.tok.pad({"input_ids": rows}, padding=True, return_tensors="pt")
        features = {k: v.to(self.device) for k, v in features.items()}
        return list(self.st(features)["sentence_embedding"].float().cpu())

    def _result(self, job: _Job) -> GenerationResult:
        torch = self.torch
        vectors = torch.stack(job.vectors)
        dims = job.spec.embed.dimensions
        if dims is not None:
            vectors = torch.nn.functional.normalize(vectors[:, :dims], dim=1)
        raw = vectors.numpy().astype("<f4")
        return GenerationResult(
            text="",
            finish_reason="stop",
            prompt_tokens=sum(len(ids) for ids in job.ids),
            completion_tokens=0,
            batch_size=job.batch_size,
            model=self.model,
            embeddings=[base64.b64encode(row.tobytes()).decode("ascii") for row in raw],
        )
