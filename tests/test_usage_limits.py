"""Usage and rate limits per API key (tasks/usage.py, webapp/limits.py `admit`,
webapp/routes/usage.py): the job store counts a job's tokens once, in the fenced call that ends
it; through the real stack (the tiny model on an hf worker) each key's `GET /v1/usage` equals
the `usage` its responses returned, a key sees only its own, an admin key every key's, and
/metrics has them by key; `rpm=` and `tpm=` answer 429 with Retry-After; the keys file's new
options, good and bad."""

from __future__ import annotations

import hashlib
import secrets
import uuid

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tasks import keys
from tasks.config import Settings
from tasks.errors import JobError
from tasks.schemas import JobSpec, JobStatus, SamplingParams
from tasks.usage import ANONYMOUS, RateLimiter, counts_of, read_usage
from webapp import auth, create_app

RUN = uuid.uuid4().hex[:6]  # key names of this run: usage counts per name over all of Redis
ALICE, BOB, ROOT, CAROL, DAVE = (f"sk-{w}-{secrets.token_hex(12)}" for w in ("alice", "bob", "root", "carol", "dave"))
NAMES = {k: f"{w}-{RUN}" for k, w in ((ALICE, "alice"), (BOB, "bob"), (ROOT, "root"), (CAROL, "carol"), (DAVE, "dave"))}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def usage_of(store, owner: str, model: str) -> dict:
    rows = [u.view() for u in read_usage(store.r) if u.key == owner and u.model == model]
    assert len(rows) <= 1
    return rows[0] if rows else {}


def owned_job(store, owner: str, model: str) -> str:
    spec = JobSpec(id=str(uuid.uuid4()), model=model, prompt="p", params=SamplingParams(), owner=owner or None)
    assert store.create([spec], f"genq.test-{uuid.uuid4().hex[:6]}", 10)[0]
    return spec.id


# -- in process, against the session's Redis ----------------------------------------------------


def test_a_job_is_counted_once_by_the_call_that_ends_it(store):
    owner, model = f"o-{uuid.uuid4().hex[:8]}", f"m-{uuid.uuid4().hex[:8]}"
    job = owned_job(store, owner, model)
    assert store.start(job, "w1", "t1").number == 1
    assert store.start(job, "w2", "t2").number == 2  # its first worker was lost: delivered again
    # The lost attempt's late success neither moves the job nor counts.
    assert store.succeed(job, 1, "{}", (7, 70, 0)) is False
    assert usage_of(store, owner, model) == {}
    assert store.succeed(job, 2, "{}", (5, 3, 2)) is True
    assert store.succeed(job, 2, "{}", (5, 3, 2)) is False  # already final
    expected = dict(key=owner, model=model, jobs=1, prompt_tokens=5, completion_tokens=3, cached_tokens=2)
    assert usage_of(store, owner, model) == {**expected, "total_tokens": 8}
    # A failed job that kept a partial result counts its tokens; a cancelled one nothing.
    failed = owned_job(store, owner, model)
    store.start(failed, "w1", "t3")
    partial = {"text": "x", "prompt_tokens": 4, "completion_tokens": 1}
    moved, _ = store.finish(failed, JobStatus.failed, JobError("timeout", "t"), 1, partial, counts_of(partial))
    assert moved
    cancelled = owned_job(store, owner, model)
    store.cancel(cancelled)
    assert store.finish(cancelled, JobStatus.failed, None, 0, partial, counts_of(partial)) == (
        False,
        JobStatus.cancelled,
    )
    got = usage_of(store, owner, model)
    assert (got["jobs"], got["prompt_tokens"], got["completion_tokens"]) == (2, 9, 4)
    # Their tokens are in the owner's minute (tpm): 13 of them.
    limiter = RateLimiter(store.r)
    refused = limiter.admit(owner, None, 13)
    assert refused.refused == "tpm" and refused.tokens == 13 and 1 <= refused.retry_after <= 60
    assert limiter.admit(owner, None, 14).refused is None


def test_an_open_apis_jobs_count_as_anonymous(store):
    model = f"m-{uuid.uuid4().hex[:8]}"
    job = owned_job(store, "", model)
    store.start(job, "w1", "t1")
    assert store.succeed(job, 1, "{}", (1, 2, 0))
    assert usage_of(store, ANONYMOUS, model)["total_tokens"] == 3


def test_rpm_window(store):
    owner = f"o-{uuid.uuid4().hex[:8]}"
    limiter = RateLimiter(store.r)
    assert [limiter.admit(owner, 3, None).refused for _ in range(3)] == [None, None, None]
    refused = limiter.admit(owner, 3, None)
    assert refused.refused == "rpm" and refused.requests == 3 and 1 <= refused.retry_after <= 60
    assert limiter.admit(owner, 4, None).refused is None  # a refusal is not counted; this one is
    assert limiter.admit(owner, 4, None).refused == "rpm"
    # Seconds that left the window are dropped: an old bucket no longer counts.
    store.r.delete(keys.rate("rpm", owner))
    store.r.hset(keys.rate("rpm", owner), "1000", 50)
    assert limiter.admit(owner, 1, None).refused is None and store.r.hkeys(keys.rate("rpm", owner)) != ["1000"]


def test_keys_file_rate_and_admin_options():
    key = auth.parse_line("k name=a rpm=60 tpm=10000 admin=true", "x")
    assert (key.rpm, key.tpm, key.admin, key.max_queued) == (60, 10000, True, None)
    plain = auth.parse_line("k", "x")
    assert (plain.rpm, plain.tpm, plain.admin) == (None, None, False)
    assert auth.parse_line("k admin=false", "x").admin is False
    for bad, field in (
        ("k rpm=0", "rpm"),
        ("k rpm=-1", "rpm"),
        ("k tpm=1.5", "tpm"),
        ("k tpm=", "tpm"),
        ("k admin=yes", "admin"),
        ("k rpm=1 rpm=2", "rpm"),
        ("k role=admin", "role"),
    ):
        with pytest.raises(ValueError) as info:
            auth.parse_line(bad.replace("k", "s3cret", 1), "keys line 3")
        message = str(info.value)
        assert "keys line 3" in message and field in message and "s3cret" not in message


def test_a_bad_keys_file_stops_the_app_at_start(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-one name=one\nsk-two name=two tpm=lots\n")
    with pytest.raises(ValueError, match=r"line 2: tpm: a whole number"):
        create_app(Settings(api_keys_file=str(path)))


# -- the real stack -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(make_module_stack, tmp_path_factory):
    path = tmp_path_factory.mktemp("usage") / "keys"
    path.write_text(
        f"{ALICE} name={NAMES[ALICE]}\n"
        f"sha256:{hashlib.sha256(BOB.encode()).hexdigest()} name={NAMES[BOB]}\n"
        f"{ROOT} name={NAMES[ROOT]} admin=true\n"
        f"{CAROL} name={NAMES[CAROL]} rpm=2\n"
        f"{DAVE} name={NAMES[DAVE]} tpm=8\n"
    )
    s = make_module_stack(GENQ_API_KEYS_FILE=str(path))
    s.start_api()
    s.start_worker()
    s.wait_ready()
    return s


def complete(stack, key: str, **body) -> dict:
    resp = stack.post("/v1/completions", json={"max_tokens": 3, **body}, headers=bearer(key))
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]


def own_usage(stack, key: str) -> list[dict]:
    resp = stack.get("/v1/usage", headers=bearer(key))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["key"] == NAMES[key] and body["admin"] is (key == ROOT)
    return [row for row in body["data"] if row["model"] == stack.name]


def test_usage_equals_the_tokens_returned_and_each_key_sees_its_own(keyed):
    returned = {ALICE: [0, 0, 0, 0], BOB: [0, 0, 0, 0]}  # jobs, prompt, completion, cached

    def add(key: str, usage: dict, jobs: int) -> None:
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        for i, v in enumerate((jobs, usage["prompt_tokens"], usage["completion_tokens"], cached)):
            returned[key][i] += v

    add(ALICE, complete(keyed, ALICE, prompt=["one two three", "four five six seven"]), 2)
    add(ALICE, complete(keyed, ALICE, prompt="eight nine", n=2, seed=1), 2)
    add(BOB, complete(keyed, BOB, prompt="ten eleven twelve", max_tokens=5), 1)
    # The job API: the job's own result has its counts.
    resp = keyed.post("/v1/jobs", json={"prompt": "thirteen", "max_new_tokens": 2}, headers=bearer(BOB))
    assert resp.status_code == 202, resp.text
    job = keyed.get(f"/v1/jobs/{resp.json()['id']}?wait=60", headers=bearer(BOB)).json()
    assert job["status"] == "succeeded", job
    add(BOB, {**job["result"], "prompt_tokens_details": {"cached_tokens": job["result"]["cached_tokens"]}}, 1)

    for key in (ALICE, BOB):
        jobs, prompt, completion, cached = returned[key]
        assert prompt > 0 and completion > 0
        assert own_usage(keyed, key) == [
            {
                "key": NAMES[key],
                "model": keyed.name,
                "jobs": jobs,
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "cached_tokens": cached,
                "total_tokens": prompt + completion,
            }
        ]
    # Another key's usage is an admin's to see.
    resp = keyed.get("/v1/usage", params={"key": NAMES[BOB]}, headers=bearer(ALICE))
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "forbidden"
    assert resp.json()["error"]["param"] == "key"
    assert keyed.get("/v1/usage", params={"key": NAMES[ALICE]}, headers=bearer(ALICE)).status_code == 200
    assert keyed.get("/v1/usage").status_code == 401
    everyone = {(r["key"], r["model"]): r for r in own_usage(keyed, ROOT)}
    for key in (ALICE, BOB):
        assert everyone[(NAMES[key], keyed.name)] == own_usage(keyed, key)[0]
    only_bob = keyed.get("/v1/usage", params={"key": NAMES[BOB]}, headers=bearer(ROOT)).json()["data"]
    assert {r["key"] for r in only_bob} == {NAMES[BOB]}

    # /metrics (no key needed) has the same counts by key name.
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(requests.get(keyed.base + "/metrics", timeout=10).text)
        for s in family.samples
    }
    for key in (ALICE, BOB):
        jobs, prompt, completion, cached = returned[key]
        labels = {"key": NAMES[key], "model_name": keyed.name}
        for kind, value in (("prompt", prompt), ("completion", completion), ("cached", cached)):
            assert samples[("genq:key_tokens_total", frozenset({**labels, "kind": kind}.items()))] == value
        assert samples[("genq:key_jobs_total", frozenset(labels.items()))] == jobs


def test_rpm_answers_429_with_retry_after(keyed):
    # A request refused for its input is not counted.
    bad = keyed.post("/v1/jobs", json={"prompt": "x", "max_new_tokens": 0}, headers=bearer(CAROL))
    assert bad.status_code == 400
    for _ in range(2):
        resp = keyed.post("/v1/jobs", json={"prompt": "one", "max_new_tokens": 1}, headers=bearer(CAROL))
        assert resp.status_code == 202, resp.text
    for path, body in (("/v1/jobs", {"prompt": "one"}), ("/v1/completions", {"prompt": "one", "max_tokens": 1})):
        resp = keyed.post(path, json=body, headers=bearer(CAROL))
        assert resp.status_code == 429, resp.text
        err = resp.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and "rpm" in err["message"]
        assert 1 <= int(resp.headers["Retry-After"]) <= 60
    # Other keys are not limited by it.
    assert keyed.post("/v1/jobs", json={"prompt": "one"}, headers=bearer(ALICE)).status_code == 202


def test_tpm_answers_429_once_the_minutes_tokens_reach_it(keyed):
    usage = complete(keyed, DAVE, prompt="one two three four five six seven eight nine", max_tokens=2)
    assert usage["total_tokens"] >= 8  # the key's tpm: its next request waits
    resp = keyed.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=bearer(DAVE))
    assert resp.status_code == 429, resp.text
    err = resp.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and "tpm" in err["message"]
    assert 1 <= int(resp.headers["Retry-After"]) <= 60
    resp = keyed.get("/v1/usage", headers=bearer(DAVE)).json()
    assert resp["limits"] == {"rpm": None, "tpm": 8}
