"""Closed-loop load test for the genqueue HTTP API, against a running stack::

    locust -f locustfile.py --headless -u 10 -r 10 -t 60s --host http://127.0.0.1:8000 [UserClass ...]

One user class per way in: `JobsUser` (submit, then long-poll), `StreamingUser` (submit, then
read the SSE stream), `BasicGenerateUser` and `BatchGenerateUser` (the teaching endpoints),
`CompletionsUser` and `ChatCompletionsUser` (OpenAI's). Each user has at most one request in
flight and checks every answer; a 429 is a failure, after which the user sleeps for its
Retry-After. Beside the HTTP requests, the statistics get entries of their own: `JOB` (submit to
a terminal status), `TTFT`, `ITL` and `QUEUE`. What each class checks and reports, and the
GENQ_LOCUST_* settings: docs/operations.md, "Load testing: locust".
"""

from __future__ import annotations

import os
import random
import time
from email.utils import parsedate_to_datetime

from locust import HttpUser, constant, task

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Once upon a time,",
    "The quick brown fox",
    "In the year 2050, computers will",
    "My favourite recipe for soup is",
    "The best way to learn a language is",
    "Redis is a",
]

TERMINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled", "expired"})

QUEUE_FULL_FAILURE = "429 Too Many Requests (queue full)"

JOB_SUBMIT_NAME = "/v1/jobs"
JOB_POLL_NAME = "/v1/jobs/[id]?wait"
JOB_E2E_NAME = "/v1/jobs (end-to-end)"
JOB_E2E_TYPE = "JOB"

# Measurements of their own (request types) beside the HTTP requests.
TTFT_TYPE, ITL_TYPE, QUEUE_TYPE = "TTFT", "ITL", "QUEUE"
STREAM_NAME = "/v1/jobs/[id]/stream"
QUEUE_NAME = "queue time (job record)"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"{name} must be an integer, got {raw!r}") from None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise SystemExit(f"{name} must be a number, got {raw!r}") from None


MAX_NEW_TOKENS = _env_int("GENQ_LOCUST_MAX_NEW_TOKENS", 32)
API_KEY = os.environ.get("GENQ_API_KEY", "").strip() or None
MODEL = os.environ.get("GENQ_LOCUST_MODEL", "").strip() or None
POLL_WAIT = _env_float("GENQ_LOCUST_POLL_WAIT", 30.0)
JOB_TIMEOUT = _env_float("GENQ_LOCUST_JOB_TIMEOUT", 600.0)
REQUEST_TIMEOUT = _env_float("GENQ_LOCUST_REQUEST_TIMEOUT", 300.0)
MAX_RETRY_AFTER = _env_float("GENQ_LOCUST_MAX_RETRY_AFTER", 30.0)
DEFAULT_RETRY_AFTER = 1.0


def _sleep(seconds: float) -> None:
    # Locust monkey-patches time.sleep with gevent's, so this yields to other users.
    time.sleep(seconds)


def retry_after_seconds(headers) -> float:
    """Seconds to back off after a 429, from Retry-After (delta-seconds or HTTP-date)."""
    raw = (headers or {}).get("Retry-After")
    seconds = DEFAULT_RETRY_AFTER
    if raw:
        raw = str(raw).strip()
        try:
            seconds = float(raw)
        except ValueError:
            try:
                seconds = parsedate_to_datetime(raw).timestamp() - time.time()
            except (TypeError, ValueError, OverflowError):
                seconds = DEFAULT_RETRY_AFTER
    return max(0.0, min(seconds, MAX_RETRY_AFTER))


def _json(resp):
    try:
        return resp.json()
    except Exception:  # noqa: BLE001 - any decode problem is a failed request
        return None


class _GenqUser(HttpUser):
    """Shared helpers; abstract so locust does not spawn it."""

    abstract = True
    wait_time = constant(0)

    def on_start(self) -> None:
        if API_KEY:
            self.client.headers["Authorization"] = f"Bearer {API_KEY}"

    def _handle_queue_full(self, resp) -> bool:
        """Mark a 429 as a clearly named failure and back off. True if it was one."""
        if resp.status_code != 429:
            return False
        resp.failure(QUEUE_FULL_FAILURE)
        self._backoff = retry_after_seconds(resp.headers)
        return True

    def _pause_if_backing_off(self) -> None:
        delay = getattr(self, "_backoff", 0.0)
        self._backoff = 0.0
        if delay > 0:
            _sleep(delay)

    def _fire(self, request_type: str, name: str, seconds: float, exception: Exception | None = None) -> None:
        """A measurement of its own in locust's statistics (web UI, CSV), not an HTTP request."""
        self.environment.events.request.fire(
            request_type=request_type,
            name=name,
            response_time=seconds * 1000.0,
            response_length=0,
            response=None,
            context={},
            exception=exception,
        )

    def _report_queue_time(self, job: dict | None) -> None:
        """The job record's queue time (created by the API -> started by a worker), if it has one."""
        queued = ((job or {}).get("timings") or {}).get("queued_s")
        if isinstance(queued, (int, float)):
            self._fire(QUEUE_TYPE, QUEUE_NAME, queued)

    def _job_body(self) -> dict:
        body: dict = {"prompt": random.choice(PROMPTS), "max_new_tokens": MAX_NEW_TOKENS}
        if MODEL:
            body["model"] = MODEL
        return body

    def _submit(self, body: dict) -> str | None:
        """POST /v1/jobs; the job's id, or None (a failure was reported)."""
        with self.client.post(
            "/v1/jobs", json=body, name=JOB_SUBMIT_NAME, catch_response=True, timeout=REQUEST_TIMEOUT
        ) as resp:
            if self._handle_queue_full(resp):
                return None
            if resp.status_code != 202:
                resp.failure(f"submit: expected 202, got {resp.status_code}")
                return None
            data = _json(resp)
            job_id = data.get("id") if isinstance(data, dict) else None
            if not job_id:
                resp.failure("submit: 202 without a job id")
                return None
            resp.success()
            return job_id

    def _post_checked(self, path: str, body: dict, check) -> None:
        """POST `body`; a 200 whose JSON `check` finds nothing wrong with is a success."""
        with self.client.post(path, json=body, name=path, catch_response=True, timeout=REQUEST_TIMEOUT) as resp:
            if self._handle_queue_full(resp):
                pass
            elif resp.status_code != 200:
                resp.failure(f"expected 200, got {resp.status_code}")
            else:
                problem = check(_json(resp))
                if problem:
                    resp.failure(problem)
                else:
                    resp.success()
        self._pause_if_backing_off()


class JobsUser(_GenqUser):
    """Submit a job, then long-poll it until it finishes."""

    weight = 1

    def _report_job(self, started: float, exception: Exception | None, length: int = 0) -> None:
        self.environment.events.request.fire(
            request_type=JOB_E2E_TYPE,
            name=JOB_E2E_NAME,
            response_time=(time.perf_counter() - started) * 1000.0,
            response_length=length,
            response=None,
            context={},
            exception=exception,
        )

    @task
    def submit_and_wait(self) -> None:
        started = time.perf_counter()
        job_id = self._submit(self._job_body())
        if job_id is None:
            self._pause_if_backing_off()
            return

        deadline = time.monotonic() + JOB_TIMEOUT
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._report_job(started, TimeoutError(f"job not finished after {JOB_TIMEOUT:g}s"))
                return
            wait = max(0.0, min(POLL_WAIT, remaining))
            status = None
            data = None
            with self.client.get(
                f"/v1/jobs/{job_id}",
                params={"wait": f"{wait:g}"},
                name=JOB_POLL_NAME,
                catch_response=True,
                timeout=wait + REQUEST_TIMEOUT,
            ) as resp:
                if self._handle_queue_full(resp):
                    pass
                elif resp.status_code != 200:
                    resp.failure(f"poll: expected 200, got {resp.status_code}")
                else:
                    data = _json(resp)
                    status = data.get("status") if isinstance(data, dict) else None
                    if status is None:
                        resp.failure("poll: response has no status")
                    elif status in TERMINAL_STATUSES and status != "succeeded":
                        resp.failure(f"job {status}")
                    elif status == "succeeded" and not isinstance((data.get("result") or {}).get("text"), str):
                        resp.failure("job succeeded without result.text")
                        status = "invalid"
                    else:
                        resp.success()

            if status == "succeeded":
                text = data["result"]["text"]
                self._report_job(started, None, len(text))
                self._report_queue_time(data)
                return
            if status is None or status in TERMINAL_STATUSES or status == "invalid":
                # Unusable poll or a terminal non-success: the job as a whole failed.
                self._report_job(started, RuntimeError(f"job ended {status or 'with a failed poll'}"))
                self._pause_if_backing_off()
                return
            # queued / running: the long-poll timed out, poll again.


class BasicGenerateUser(_GenqUser):
    """The synchronous single-prompt endpoint."""

    weight = 1

    @task
    def basic_generate(self) -> None:
        prompt = random.choice(PROMPTS)

        def check(data) -> str | None:
            text = data.get("generated_text") if isinstance(data, dict) else None
            if not isinstance(text, str):
                return "no generated_text in response"
            if not text.startswith(prompt):
                return "generated_text does not start with the prompt"
            return None

        self._post_checked("/basic_generate", {"prompt": prompt}, check)


class BatchGenerateUser(_GenqUser):
    """The synchronous multi-prompt endpoint."""

    weight = 1
    batch_size = 3

    @task
    def generate(self) -> None:
        prompts = random.sample(PROMPTS, self.batch_size)

        def check(data) -> str | None:
            texts = data.get("generated_texts") if isinstance(data, dict) else None
            if not isinstance(texts, list) or len(texts) != len(prompts):
                return "generated_texts missing or of the wrong length"
            if not all(isinstance(t, str) and t.startswith(p) for p, t in zip(prompts, texts)):
                return "a generated_texts entry does not start with its prompt"
            return None

        self._post_checked("/generate", {"prompts": prompts}, check)


class CompletionsUser(_GenqUser):
    """OpenAI's completions, as OpenAI clients and vLLM's benchmark send them."""

    weight = 1

    @task
    def completions(self) -> None:
        body = {"prompt": random.choice(PROMPTS), "max_tokens": MAX_NEW_TOKENS}
        if MODEL:
            body["model"] = MODEL

        def check(data) -> str | None:
            choices = data.get("choices") if isinstance(data, dict) else None
            if not choices or not isinstance(choices[0].get("text"), str):
                return "no choices[0].text in response"
            return None

        self._post_checked("/v1/completions", body, check)


class ChatCompletionsUser(_GenqUser):
    """OpenAI's chat completions: one user message."""

    weight = 1

    @task
    def chat(self) -> None:
        body = {"messages": [{"role": "user", "content": random.choice(PROMPTS)}], "max_tokens": MAX_NEW_TOKENS}
        if MODEL:
            body["model"] = MODEL

        def check(data) -> str | None:
            choices = data.get("choices") if isinstance(data, dict) else None
            message = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                return "no choices[0].message.content in response"
            return None

        self._post_checked("/v1/chat/completions", body, check)


class StreamingUser(_GenqUser):
    """Submit a job, then read its token stream (SSE) to the end: time to first token (from the
    submit) and each gap between two tokens are entries of their own (`TTFT` and `ITL`, named
    like the stream), and the job's queue time from its record (`QUEUE`)."""

    weight = 1

    @task
    def stream(self) -> None:
        started = time.perf_counter()
        job_id = self._submit(self._job_body())
        if job_id is None:
            self._pause_if_backing_off()
            return
        last = None
        with self.client.get(
            f"/v1/jobs/{job_id}/stream",
            name=STREAM_NAME,
            stream=True,
            catch_response=True,
            timeout=REQUEST_TIMEOUT,
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"stream: expected 200, got {resp.status_code}")
                return
            event, ended = "message", None
            for line in resp.iter_lines(decode_unicode=True):
                if line.startswith("event: "):
                    event = line[len("event: ") :]
                elif line.startswith("data: ") and event in ("token", "done"):
                    now = time.perf_counter()
                    if last is None:
                        self._fire(TTFT_TYPE, STREAM_NAME, now - started)
                    elif event == "token":
                        self._fire(ITL_TYPE, STREAM_NAME, now - last)
                    last = now
                    if event == "done":
                        ended = "done"
                        break
                elif line.startswith("data: "):
                    ended = f"stream ended with {event}: {line[len('data: ') :][:200]}"
                    break
                elif line == "":
                    event = "message"
            if ended == "done":
                resp.success()
            else:
                resp.failure(ended or "stream closed before its done event")
                return
        with self.client.get(
            f"/v1/jobs/{job_id}", name=JOB_POLL_NAME, catch_response=True, timeout=REQUEST_TIMEOUT
        ) as resp:
            if resp.status_code == 200:
                resp.success()
                self._report_queue_time(_json(resp))
            else:
                resp.failure(f"job record: expected 200, got {resp.status_code}")
