"""The API's questions to a worker of its model (/tokenize, /detokenize, and the count of a
prompt's tokens for its check against the context at submit, webapp/context.py), answered on
threads of their own beside Celery's.

Sent as a Celery task (`genq.tokenize`), a question needs one of the worker's task threads, and
under load every one of them runs a generation job: the worker runs capacity + reserved threads
and prefetches as many messages, so the question stays in Redis until a job ends, and a chat
request waits behind it before it is even queued. Instead, where a live worker of the model
announces `answers_asks` (tasks/registry.py), the API pushes each question onto the model's ask
list (tasks/keys.py `asks`), and `ASK_THREADS` threads per worker pop it, answer it as the task
does (worker/chat.py `Chat.answer`) and push the answer onto the question's reply list, which
the API pops (webapp/tokens.py). A question whose deadline has passed (the API stopped waiting)
is dropped unanswered; one popped by a worker that dies is never answered, and the API answers
504 after its wait, as when a worker died holding the task.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import redis

from tasks import keys

log = logging.getLogger(__name__)

# Threads per worker: a long prompt being tokenized leaves another for the counts behind it.
ASK_THREADS = 2
# How long one pop blocks (and a stopping thread takes to notice), and how long an answer
# waits for the API to pop it.
POP_S = 1.0
REPLY_TTL_S = 60


class Answerers:
    """The threads that answer the questions of one worker's model (`queue`: its Celery queue,
    which names the ask list) with `chat` (the worker's Chat, or one without a tokenizer)."""

    def __init__(self, client: redis.Redis, chat: Any, queue: str, threads: int = ASK_THREADS):
        self.r, self.chat, self.key = client, chat, keys.asks(queue)
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._run, name=f"genq-asks-{i}", daemon=True) for i in range(threads)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.stopped.set()
        for t in self.threads:
            if t.is_alive():
                t.join(timeout=POP_S + 1)

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                got = self.r.blpop([self.key], timeout=POP_S)
                if got is not None:
                    self.answer(json.loads(got[1]))
            except (redis.RedisError, OSError) as exc:
                log.warning("answering the API's questions: %s", exc)
                self.stopped.wait(POP_S)
            except Exception:  # noqa: BLE001 - one bad question must not stop the answers
                log.exception("a question from the API could not be answered")

    def answer(self, req: dict) -> None:
        """Answer one question onto its reply list, unless the API has stopped waiting."""
        if time.time() > req.get("deadline", float("inf")):
            return
        body = json.dumps(self.chat.answer(req))
        pipe = self.r.pipeline()
        pipe.rpush(keys.reply(req["id"]), body)
        pipe.expire(keys.reply(req["id"]), REPLY_TTL_S)
        pipe.execute()
