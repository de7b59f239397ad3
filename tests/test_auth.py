"""API keys through the real stack: 401 on every protected route, jobs visible to their own key
only, per-key quotas, the official `openai` client's `api_key=`, and keys that never reach a
log, a job record or a Celery message. The keys file parser and the start-up notice in process.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import secrets
import time
import uuid

import openai
import pytest
import redis

from tasks.config import Settings
from tasks.fair import message_of
from tests.helpers import sse_events
from webapp import auth, create_app

RUN = uuid.uuid4().hex[:6]  # owner names of this run: quotas count per name over all of Redis
ALICE, BOB, CAROL, DAVE = (f"sk-{who}-{secrets.token_hex(12)}" for who in ("alice", "bob", "carol", "dave"))
NAMES = {ALICE: f"alice-{RUN}", BOB: f"bob-{RUN}", CAROL: f"carol-{RUN}"}
DAVE_NAME = auth.default_name(auth.digest(DAVE))
WRONG = "sk-wrong-" + secrets.token_hex(12)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "keys"
    path.write_text(
        "# who may call this API\n"
        f"sha256:{hashlib.sha256(ALICE.encode()).hexdigest()} name={NAMES[ALICE]}\n"
        "\n"
        f"{BOB} name={NAMES[BOB]} max_new_tokens=8\n"
        f"  {CAROL}   name={NAMES[CAROL]}  max_queued=2\n"
    )
    return path


@pytest.fixture(scope="module")
def keyed(make_module_stack, keys_file):
    """Keys from the file and GENQ_API_KEYS, an echo worker that logs at DEBUG."""
    s = make_module_stack(GENQ_API_KEYS_FILE=str(keys_file), GENQ_API_KEYS=f" {DAVE} ,", GENQ_ENGINE="echo")
    s.start_api()
    s.start_worker(GENQ_LOG_LEVEL="DEBUG")
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def idle(make_module_stack, keys_file, redis_url):
    """The same keys and no worker: submitted jobs stay queued. Cancels them at the end."""
    s = make_module_stack(GENQ_API_KEYS_FILE=str(keys_file), GENQ_API_KEYS=DAVE)
    s.start_api()
    s.jobs = []
    yield s
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    for job_id, key in s.jobs:
        s.post(f"/v1/jobs/{job_id}/cancel", headers=bearer(key))
    for name in r.scan_iter(f"genq.{s.name}*"):
        r.delete(name)


@pytest.fixture(scope="module")
def r(redis_url):
    return redis.Redis.from_url(redis_url, decode_responses=True)


def submit(stack, key: str, **body):
    resp = stack.post(
        "/v1/jobs", json={"prompt": "one two three four", "max_new_tokens": 2, **body}, headers=bearer(key)
    )
    if resp.status_code == 202 and hasattr(stack, "jobs"):
        stack.jobs.append((resp.json()["id"], key))
    return resp


def assert_error(resp, status: int, code: str):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code and err["type"] == "invalid_request_error" and err["message"]
    return err


# -- who may call what -------------------------------------------------------------------------


def routes():
    """Every route of the app with each of its methods, path arguments filled in."""
    app = create_app(Settings())
    for rule in app.url_map.iter_rules():
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            yield method, re.sub(r"<[^>]+>", "x" + uuid.uuid4().hex, rule.rule)


def test_every_route_but_health_needs_a_key(keyed):
    checked = 0
    for method, path in routes():
        call = keyed.get if method == "GET" else keyed.post
        if path in auth.OPEN_PATHS:
            assert call(path).status_code != 401, path
            continue
        for headers, invalid in (
            ({}, False),
            (bearer(WRONG), True),
            ({"Authorization": f"Basic {ALICE}"}, False),
            ({"Authorization": "Bearer "}, False),
        ):
            resp = call(path, headers=headers)
            assert_error(resp, 401, "unauthorized")
            challenge = resp.headers["WWW-Authenticate"]
            assert challenge.startswith("Bearer ") and ('error="invalid_token"' in challenge) == invalid
        checked += 1
    assert checked >= 8
    assert keyed.get("/healthz").status_code == 200 and keyed.get("/readyz").status_code == 200
    # An unknown path does not tell that it is unknown.
    assert_error(keyed.get("/v1/nothing-here"), 401, "unauthorized")
    assert keyed.get("/v1/nothing-here", headers=bearer(ALICE)).status_code == 404


def test_every_key_works_and_names_its_jobs(keyed, r):
    for key, name in [*NAMES.items(), (DAVE, DAVE_NAME)]:
        resp = submit(keyed, key)
        assert resp.status_code == 202, resp.text
        job = keyed.get(f"/v1/jobs/{resp.json()['id']}?wait=10", headers=bearer(key)).json()
        assert job["status"] == "succeeded" and job["result"]["text"] == " three four"
        assert r.hget(f"genq:job:{job['id']}", "owner") == name
    scheme = keyed.post("/v1/jobs", json={"prompt": "a"}, headers={"Authorization": f"bearer {ALICE}"})
    assert scheme.status_code == 202


def test_a_key_cannot_see_another_keys_jobs(keyed):
    job_id = submit(keyed, ALICE).json()["id"]
    mine = keyed.get(f"/v1/jobs/{job_id}?wait=10", headers=bearer(ALICE)).json()
    assert mine["status"] == "succeeded"
    unknown = str(uuid.uuid4())
    for who in (BOB, DAVE):
        t0 = time.monotonic()
        err = assert_error(keyed.get(f"/v1/jobs/{job_id}?wait=5", headers=bearer(who)), 404, "not_found")
        assert time.monotonic() - t0 < 2, "a wait must not tell that the job exists"
        assert err["message"] == f"no job {job_id!r}"  # as for an id that does not exist:
        nothing = assert_error(keyed.get(f"/v1/jobs/{unknown}", headers=bearer(who)), 404, "not_found")
        assert nothing["message"] == f"no job {unknown!r}"
        assert_error(keyed.get(f"/v1/jobs/{job_id}/stream", headers=bearer(who)), 404, "not_found")
        assert_error(keyed.post(f"/v1/jobs/{job_id}/cancel", headers=bearer(who)), 404, "not_found")
    with keyed.http.get(
        f"{keyed.base}/v1/jobs/{job_id}/stream", headers=bearer(ALICE), stream=True, timeout=30
    ) as resp:
        assert resp.status_code == 200
        assert [e.get("event") for e in sse_events(resp)][-1] == "done"
    assert_error(keyed.post(f"/v1/jobs/{job_id}/cancel", headers=bearer(ALICE)), 409, "already_final")


def test_a_key_cancels_only_its_own_queued_job(idle):
    job_id = submit(idle, ALICE).json()["id"]
    assert_error(idle.post(f"/v1/jobs/{job_id}/cancel", headers=bearer(DAVE)), 404, "not_found")
    assert idle.get(f"/v1/jobs/{job_id}", headers=bearer(ALICE)).json()["status"] == "queued"
    resp = idle.post(f"/v1/jobs/{job_id}/cancel", headers=bearer(ALICE))
    assert resp.status_code == 200 and resp.json()["status"] == "cancelled"


def test_openai_client_with_api_key(keyed):
    base = keyed.base + "/v1"
    with openai.OpenAI(base_url=base, api_key=ALICE, max_retries=0) as client:
        out = client.completions.create(model=keyed.name, prompt="one two three", max_tokens=2)
        assert out.choices[0].text == " two three"
        chunks = list(client.completions.create(model=keyed.name, prompt="one two three", max_tokens=2, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == " two three"
    with openai.OpenAI(base_url=base, api_key=WRONG, max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as info:
            client.completions.create(model=keyed.name, prompt="Hi", max_tokens=2)
        assert info.value.code == "unauthorized"
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


# -- quotas ------------------------------------------------------------------------------------


def test_max_queued_counts_a_keys_waiting_jobs(idle, r):
    first = [submit(idle, CAROL) for _ in range(2)]
    assert [x.status_code for x in first] == [202, 202]
    over = submit(idle, CAROL)
    err = assert_error(over, 429, "quota_exceeded")
    assert over.headers["Retry-After"] and "limit is 2" in err["message"]
    assert r.zcard(f"genq:queued-by:{NAMES[CAROL]}") == 2
    # Another key's jobs do not count, nor do they get in the way.
    assert submit(idle, ALICE).status_code == 202
    # Cancelling a queued job frees its place.
    idle.post(f"/v1/jobs/{first[0].json()['id']}/cancel", headers=bearer(CAROL))
    assert r.zcard(f"genq:queued-by:{NAMES[CAROL]}") == 1
    again = submit(idle, CAROL)
    assert again.status_code == 202
    assert_error(submit(idle, CAROL), 429, "quota_exceeded")
    for resp in (first[1], again):
        idle.post(f"/v1/jobs/{resp.json()['id']}/cancel", headers=bearer(CAROL))
    assert r.zcard(f"genq:queued-by:{NAMES[CAROL]}") == 0


def test_jobs_that_ran_no_longer_count(keyed, r):
    for _ in range(3):
        ids = [submit(keyed, CAROL).json()["id"] for _ in range(2)]
        for job_id in ids:
            assert keyed.get(f"/v1/jobs/{job_id}?wait=10", headers=bearer(CAROL)).json()["status"] == "succeeded"
    assert r.zcard(f"genq:queued-by:{NAMES[CAROL]}") == 0
    # More prompts in one request than the key may have waiting can never fit: 413, not 429.
    resp = keyed.post("/generate", json={"prompts": ["a", "b", "c"]}, headers=bearer(CAROL))
    assert_error(resp, 413, "too_many_prompts")


def test_max_new_tokens_ceiling(keyed):
    err = assert_error(submit(keyed, BOB, max_new_tokens=9), 400, "invalid_request")
    assert "8" in err["message"] and "API key" in err["message"]
    assert submit(keyed, ALICE, max_new_tokens=9).status_code == 202
    # No max_new_tokens: the key's ceiling, not the larger default (32).
    resp = keyed.post("/v1/jobs", json={"prompt": " ".join(map(str, range(40)))}, headers=bearer(BOB))
    job = keyed.get(f"/v1/jobs/{resp.json()['id']}?wait=10", headers=bearer(BOB)).json()
    assert job["result"]["completion_tokens"] == 8
    with openai.OpenAI(base_url=keyed.base + "/v1", api_key=BOB, max_retries=0) as client:
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=keyed.name, prompt="Hi", max_tokens=9)


# -- secrets stay secret -----------------------------------------------------------------------


def test_keys_reach_no_log_record_or_message(keyed, idle, r):
    """Last in this file: checks what the tests above left behind."""
    secrets_ = [ALICE, BOB, CAROL, DAVE]
    job_id = submit(idle, ALICE).json()["id"]
    record = r.hgetall(f"genq:job:{job_id}")
    assert record["owner"] == NAMES[ALICE]
    # On its queue's lists, or (fair share: tasks/fair.py) in its key's line.
    lists = [*r.scan_iter(f"genq.{idle.name}*"), *r.scan_iter(f"genq:fair:genq.{idle.name}*")]
    messages = [message_of(m) for q in lists if r.type(q) == "list" for m in r.lrange(q, 0, -1)]
    mine = [m for m in messages if job_id in m]
    assert mine
    (message,) = mine
    spec = json.loads(base64.b64decode(json.loads(message)["body"]))[0][0]
    assert spec["owner"] == NAMES[ALICE]
    assert NAMES[ALICE] in json.loads(message)["headers"]["argsrepr"]
    logs = [p.read_text() for p in keyed.logs.iterdir() if p.name.startswith((keyed.name, idle.name))]
    assert len(logs) == 3 and any(NAMES[ALICE] in text for text in logs)
    api_log = (keyed.logs / f"{keyed.name}-api.log").read_text()
    assert f"API keys required; 4 key(s): {DAVE_NAME}, {', '.join(NAMES.values())}" in api_log
    for text in [*logs, *messages, json.dumps(record)]:
        for key in secrets_:
            assert key not in text


# -- in process --------------------------------------------------------------------------------


def test_keys_file_lines():
    d = hashlib.sha256(b"k").hexdigest()
    key = auth.parse_line(f"sha256:{d.upper()} name=a.b@c max_queued=3 max_new_tokens=5 weight=2", "x")
    assert (key.name, key.digest, key.max_queued, key.max_new_tokens) == ("a.b@c", bytes.fromhex(d), 3, 5)
    assert key.weight == 2 and auth.parse_line("k", "x").weight == 1
    assert auth.KeyTable([key]).find("k") is key and auth.KeyTable([key]).find("K") is None
    assert auth.parse_line("k", "x").name == "key-" + d[:8] and d[8:16] not in repr(auth.parse_line("k", "x"))
    for bad in (
        "sha256:abc",
        "k name=",
        "k name=a/b",
        "k max_queued=0",
        "k max_queued=x",
        "k owner=a",
        "k name=a name=b",
        "k limit",
        "k weight=0",
        "k weight=1.5",
    ):
        with pytest.raises(ValueError) as info:
            auth.parse_line(bad.replace("k", "s3cret", 1), "keys line 1")
        assert "s3cret" not in str(info.value) and "keys line 1" in str(info.value)


def test_keys_configured_but_empty_or_repeated_are_refused(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="hold no key"):
        auth.load_keys(Settings(api_keys_file=str(path)))
    path.write_text("a name=x\nb name=x\n")
    with pytest.raises(ValueError, match="name"):
        auth.load_keys(Settings(api_keys_file=str(path)))
    with pytest.raises(ValueError, match="same key"):
        auth.load_keys(Settings(api_keys="a,a"))
    assert auth.load_keys(Settings()) == [] and not Settings(api_keys=" ").auth_enabled


def test_start_up_notice(caplog, tmp_path):
    log = logging.getLogger("test.auth")
    with caplog.at_level(logging.INFO, logger="test.auth"):
        auth.announce(Settings(host="127.0.0.1"), log)
        assert caplog.records == []
        auth.announce(Settings(host="0.0.0.0"), log)
        (warning,) = caplog.records
        assert warning.levelno == logging.WARNING and "no API keys" in warning.getMessage()
        caplog.clear()
        auth.announce(Settings(host="0.0.0.0", api_keys="s3cret-one,s3cret-two"), log)
        (info,) = caplog.records
        assert info.levelno == logging.INFO and "2 key(s)" in info.getMessage() and "s3cret" not in info.getMessage()
