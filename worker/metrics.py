"""A worker's Prometheus metrics and its job log lines.

Named like vLLM's (`genq:` for `vllm:`, the same buckets, labels and label values), so that
dashboards and alerts written for vLLM read ours. Each worker process serves its own
(`GENQ_METRICS_PORT`, 0 = off; the first free port from there, announced in its heartbeat).
The numbers come from a few hooks, so that engines and the task stay as they are:
`job_started` / `job_finished` (the Celery task; they write the job's log lines too),
`tokens_published` (the publisher: time to first token and inter-token latency as a streaming
client sees them), `decode_step`, `preempted` and `prefix_cache` (the hf engine). With the exporter off nothing
is observed; the log lines stay. Where each number starts and ends: docs/design.md, "Worker
metrics".
"""

from __future__ import annotations

import logging
import time

import prometheus_client as prom
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from tasks.logs import job_event

log = logging.getLogger(__name__)

# vLLM's buckets (vllm/v1/metrics/buckets.py).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

# Ports tried from GENQ_METRICS_PORT on, for several workers on one host.
PORT_RANGE = 64

# vLLM labels `engine` with its engine core's index (vllm/v1/metrics/loggers.py); a worker
# process holds one engine, so it is "0" whichever kind it is (`genq:workers_live` says which).
ENGINE_INDEX = "0"
# vLLM's finish reasons (vllm/v1/engine FinishReason), the values of `finished_reason`.
FINISHED_REASONS = ("stop", "length", "abort", "error")
# Ours, as vLLM counts them: EOS and stop strings/ids are `stop`; a job cancelled or out of time
# was aborted; any other failure is an `error`.
_FINISHED = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort", "timeout": "abort"}


def finished_reason(state: str | None, retval) -> str:
    """vLLM's `finished_reason` of a job that ended with Celery's `state` and `retval`."""
    if state == "SUCCESS" and isinstance(retval, dict):
        return _FINISHED.get(retval.get("finish_reason", ""), "error")
    if state == "FAILURE":
        return "abort" if getattr(retval, "code", None) == "timeout" else "error"
    return "abort"  # IGNORED: cancelled while running, or taken over by another worker


def token_buckets(max_model_len: int | None) -> list[int]:
    """vLLM's 1-2-5 series up to the model's context (`build_1_2_5_buckets`)."""
    top, out, scale = max_model_len or 2048, [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > top:
                return out
            out.append(m * scale)
        scale *= 10


class WorkerMetrics:
    """Every metric of one worker process, bound to its model and engine."""

    def __init__(
        self,
        model: str,
        engine: str,
        max_model_len: int | None = None,
        registry: CollectorRegistry = REGISTRY,
        device: str = "cpu",
    ):
        labels = ["model_name", "engine"]
        self.kind, engine = engine, ENGINE_INDEX

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(model, engine)

        def counter(name: str, doc: str, extra: list[str] = ()) -> Counter:
            c = Counter(name, doc, labels + list(extra), registry=registry)
            return c if extra else c.labels(model, engine)

        tokens = token_buckets(max_model_len)
        self.model, self.engine = model, engine
        self.ttft = hist(
            "genq:time_to_first_token_seconds",
            "Time to first token: the job recorded by the API to its first token event in the stream (streamed jobs).",
            TTFT_BUCKETS,
        )
        self.itl = hist(
            "genq:inter_token_latency_seconds",
            "Time between two token events of a job in its stream (streamed jobs).",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "genq:e2e_request_latency_seconds", "Job recorded by the API to finished.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = hist(
            "genq:request_queue_time_seconds",
            "Job recorded by the API to started by a worker.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = hist(
            "genq:request_inference_time_seconds", "Job started by the worker to finished.", REQUEST_LATENCY_BUCKETS
        )
        self.prompt_tokens = hist("genq:request_prompt_tokens", "Prompt tokens per finished job.", tokens)
        self.generation_tokens = hist("genq:request_generation_tokens", "Generated tokens per finished job.", tokens)
        self.prompt_total = counter("genq:prompt_tokens", "Prompt tokens of finished jobs.")
        self.generation_total = counter("genq:generation_tokens", "Tokens generated by finished jobs.")
        self.embedding_inputs = counter(
            "genq:embedding_inputs", "Inputs embedded by finished embedding jobs (embed engine; their tokens: prompt)."
        )
        self._success = counter(
            "genq:request_success",
            "Jobs finished, by vLLM's finish reason (stop, length, abort, error).",
            ["finished_reason"],
        )
        self._failure = counter(
            "genq:request_failure", "Jobs that failed (by error code) or were cancelled while running.", ["reason"]
        )
        self.running = Gauge(
            "genq:num_requests_running", "Jobs this worker is running.", labels, registry=registry
        ).labels(model, engine)
        self.batch = hist("genq:batch_size", "Jobs decoded together, per decode step (hf engine).", BATCH_BUCKETS)
        self.preemptions = counter(
            "genq:num_preemptions",
            "Background jobs (batch lines) that gave "
            "their row up to a foreground job and were taken up again later "
            "(hf engine).",
        )
        self.prefix_queries = counter(
            "genq:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache, at each job's first prefill (hf engine).",
        )
        self.prefix_hits = counter(
            "genq:prefix_cache_hits", "Of those, the tokens whose keys/values the prefix cache held (hf engine)."
        )
        # The same counts under vLLM's names, so that a dashboard made for vLLM's prefix cache
        # reads an hf worker's too (a vLLM worker's own engine exports its own).
        self.vllm_prefix = (
            (
                counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (as vLLM's)."),
                counter("vllm:prefix_cache_hits", "Of those, the tokens found in the prefix cache (as vLLM's)."),
            )
            if self.kind == "hf"
            else None
        )
        Gauge(
            "genq:engine_device_info",
            "1, labelled with where this worker's engine runs the model (cpu, cuda:N).",
            labels + ["device"],
            registry=registry,
        ).labels(model, engine, device).set(1)
        for reason in FINISHED_REASONS:  # every series exists from the start, at 0, as vLLM's
            self.success(reason)

    def success(self, reason: str) -> Counter:
        return self._success.labels(self.model, self.engine, reason)

    def failure(self, reason: str) -> Counter:
        return self._failure.labels(self.model, self.engine, reason)


class _Job:
    __slots__ = ("model", "owner", "created", "started", "last")

    def __init__(self, model: str, owner: str | None, created: float | None, started: float):
        self.model, self.owner, self.created, self.started = model, owner, created, started
        self.last: float | None = None  # when its latest token event was published


_metrics: WorkerMetrics | None = None
_jobs: dict[str, _Job] = {}  # the jobs this process runs; dict operations are atomic


def start(port: int, host: str, model: str, engine: str, max_model_len: int | None, device: str = "cpu") -> int | None:
    """Define the metrics and serve them on the first free port from `port` on; returns that
    port, or None when `port` is 0 (metrics off)."""
    global _metrics
    if not port:
        return None
    prom.disable_created_metrics()
    m = WorkerMetrics(model, engine, max_model_len, device=device)
    m.running.set_function(lambda: len(_jobs))
    for candidate in range(port, min(port + PORT_RANGE, 65536)):
        try:
            server, _ = prom.start_http_server(candidate, addr=host)
        except OSError:
            continue
        _metrics = m
        got = server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, got)
        return got
    raise OSError(f"no free port for metrics in {port}-{port + PORT_RANGE - 1} on {host}")


def _created(request) -> float | None:
    try:
        return float(getattr(request, "genq_created", None) or 0) or None
    except (TypeError, ValueError):
        return None


def job_started(spec, attempt: int, request) -> None:
    """The task took the job (`request`: its Celery request, whose headers say when the API
    recorded it)."""
    now = time.time()
    job = _Job(spec.model, getattr(spec, "owner", None), _created(request), now)
    _jobs[spec.id] = job
    queued = now - job.created if job.created else None
    if _metrics is not None and queued is not None:
        _metrics.queue.observe(max(0.0, queued))
    job_event(
        "running",
        spec.id,
        model=job.model,
        owner=job.owner,
        attempt=attempt,
        queue_s=None if queued is None else round(queued, 6),
    )


def job_finished(job_id: str, state: str | None, retval) -> None:
    """The task ended (Celery's `state`): SUCCESS with the result dict, FAILURE with the
    exception, or IGNORED (cancelled, or taken over by another worker)."""
    job = _jobs.pop(job_id, None)
    if job is None:
        return
    now = time.time()
    m = _metrics
    fields: dict = {"model": job.model, "owner": job.owner}
    if job.created:
        fields["queue_s"] = round(job.started - job.created, 6)
        fields["total_s"] = round(now - job.created, 6)
    fields["run_s"] = round(now - job.started, 6)
    if state == "SUCCESS" and isinstance(retval, dict):
        reason = retval.get("finish_reason", "")
        prompt, generated = int(retval.get("prompt_tokens", 0)), int(retval.get("completion_tokens", 0))
        job_event(
            "finished",
            job_id,
            status="succeeded",
            finish_reason=reason,
            prompt_tokens=prompt,
            completion_tokens=generated,
            **fields,
        )
        if m is not None:
            m.success(finished_reason(state, retval)).inc()
            m.prompt_total.inc(prompt)
            m.generation_total.inc(generated)
            if retval.get("embeddings") is not None:
                m.embedding_inputs.inc(len(retval["embeddings"]))
            m.prompt_tokens.observe(prompt)
            m.generation_tokens.observe(generated)
            m.inference.observe(now - job.started)
            if job.created:
                m.e2e.observe(now - job.created)
        return
    if state == "FAILURE":
        status, reason = "failed", getattr(retval, "code", None) or "internal"
    else:
        status, reason = "cancelled", "cancelled"
    job_event("finished", job_id, status=status, error=reason if status == "failed" else None, **fields)
    if m is not None:
        m.success(finished_reason(state, retval)).inc()
        m.failure(reason).inc()


def tokens_published(batch) -> None:
    """Token events just written to their streams: the publisher's batch of (events, resolved),
    `events` a list of (job id, event, attempt)."""
    m = _metrics
    if m is None:
        return
    now = time.time()
    for job_id, ev, _ in (e for events, _ in batch for e in events):
        job = _jobs.get(job_id)
        if job is None:
            continue
        if job.last is None:
            m.ttft.observe(max(0.0, now - (job.created or job.started)))
        elif not ev.finish:
            m.itl.observe(now - job.last)
        job.last = now


def decode_step(batch: int) -> None:
    m = _metrics
    if m is not None:
        m.batch.observe(batch)


def preempted(n: int) -> None:
    m = _metrics
    if m is not None and n:
        m.preemptions.inc(n)


def prefix_cache(queries: int, hits: int) -> None:
    """Prompt tokens one step looked up in the prefix cache, and found."""
    m = _metrics
    if m is not None and queries:
        m.prefix_queries.inc(queries)
        m.prefix_hits.inc(hits)
        if m.vllm_prefix is not None:
            m.vllm_prefix[0].inc(queries)
            m.vllm_prefix[1].inc(hits)
