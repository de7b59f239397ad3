"""sse.relay, the one loop behind the three token streams: keep-alives, each route's framing,
an early end, and the events closed when the response is (their jobs cancelled then). The
events are fakes here; the streams' behaviour end to end is in test_streaming/test_openai."""

from __future__ import annotations

import json
import uuid

from tasks.config import Settings, queue_for
from tasks.streams import Restart, StreamEnd, TokenEvent
from webapp import create_app, sse
from webapp.service import current_service


def frames(resp) -> list[str]:
    return [c.decode() if isinstance(c, bytes) else c for c in resp.response]


def test_relay_frames_each_kind_and_keeps_alive():
    events = [None, ("a", TokenEvent(0, "x")), ("a", Restart(2)), None, ("a", StreamEnd("failed", {}))]
    resp = sse.relay(
        iter(events),
        token=lambda j, ev: f"T{j}{ev.text}",
        end=lambda j, ev: f"E{ev.status}",
        restart=lambda j, ev: f"R{ev.attempt}",
        head=["H"],
        tail=lambda complete: [f"tail {complete}"],
    )
    assert resp.mimetype == "text/event-stream"
    assert frames(resp) == ["H", sse.KEEPALIVE, "Tax", "R2", sse.KEEPALIVE, "Efailed", "tail True"]


def test_a_last_frame_ends_the_stream_and_closes_the_events():
    closed = []

    def events():
        try:
            yield "a", TokenEvent(0, "x")
            yield "a", Restart(2)
            yield "a", TokenEvent(0, "never sent")
        finally:
            closed.append(True)

    resp = sse.relay(
        events(),
        token=lambda j, ev: ev.text,
        end=lambda j, ev: None,
        restart=lambda j, ev: sse.Last("gone"),
        tail=lambda complete: [f"tail {complete}"],
    )
    assert frames(resp) == ["x", "gone", "tail False"]
    assert closed == [True]


def test_events_are_closed_when_the_client_leaves_mid_stream():
    closed = []

    def events():
        try:
            while True:
                yield None
        finally:
            closed.append(True)

    resp = sse.relay(events(), token=lambda j, ev: None, end=lambda j, ev: None, restart=lambda j, ev: None)
    chunks = iter(resp.response)
    assert next(chunks) == sse.KEEPALIVE
    resp.close()  # what the WSGI server does when the client has gone
    assert closed == [True]


def test_the_job_stream_frames_a_restart(redis_url, monkeypatch):
    """GET /v1/jobs/{id}/stream through the relay with a sampled job's restart in it: token,
    restart, the new attempt's tokens, done (ids `attempt:index` after the restart)."""
    settings = Settings(redis_url=redis_url, model=f"nobody-{uuid.uuid4().hex[:8]}")
    app = create_app(settings)
    client = app.test_client()
    job_id = client.post("/v1/jobs", json={"prompt": "x"}).get_json()["id"]
    fake = [
        (job_id, TokenEvent(0, " a")),
        (job_id, Restart(2)),
        (job_id, TokenEvent(0, " b", attempt=2)),
        (job_id, TokenEvent(1, "", finish="length", usage={"prompt_tokens": 1, "completion_tokens": 1}, attempt=2)),
    ]
    with app.app_context():
        monkeypatch.setattr(current_service(), "events", lambda ids, after=None, cancel_on_exit=False: iter(fake))
    body = client.get(f"/v1/jobs/{job_id}/stream").get_data(as_text=True)
    blocks = [b for b in body.split("\n\n") if b]
    assert blocks[0] == 'id: 0\nevent: token\ndata: {"index": 0, "text": " a"}'
    assert blocks[1].startswith("event: restart\n") and '"attempt": 2' in blocks[1]
    assert blocks[2] == 'id: 2:0\nevent: token\ndata: {"index": 0, "text": " b"}'
    assert blocks[3].startswith("id: 2:1\nevent: done\n")
    # A worker from before the prefix cache sends no cached_tokens: the done event says 0.
    done = json.loads(blocks[3].split("data: ", 1)[1])
    assert done["usage"] == {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}
    app.extensions["genq"].r.delete(queue_for(settings.served_model))


def test_without_comments_the_headers_go_at_once_and_nothing_while_waiting():
    """The OpenAI routes' streams (comments=False): an empty first chunk (the server sends the
    headers with it), and no keep-alive for a None: outside gunicorn nothing says the client
    left, so the relay just reads on."""
    events = [None, ("a", TokenEvent(0, "x")), None, None]
    resp = sse.relay(
        iter(events),
        token=lambda j, ev: ev.text,
        end=lambda j, ev: None,
        restart=lambda j, ev: None,
        head=["H"],
        tail=lambda complete: ["done"],
        comments=False,
    )
    assert frames(resp) == ["", "H", "x", "done"]
