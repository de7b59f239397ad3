"""`make test-compose`: build both images from this checkout and check the compose stack running.

What `tests/test_compose.py` checks by reading the files, this checks with a Docker engine:

1. builds the hf image (Dockerfile, through the `api` service) and the vLLM image
   (Dockerfile.vllm) with `docker compose build`, the project's files as they are;
2. `docker compose up -d` with the profiles `vllm`, `locust` and `flower` and API keys on,
   and waits for every service to be healthy (model-init: exited 0);
3. checks against it: 401 without a key; a job on each engine by the docs' model names
   (`smollm2-135m-instruct`, `smollm2-135m-instruct-vllm`; a job without `model` goes to the
   first), each answering "What is the capital of France?" with Paris; Flower behind its
   basic auth; locust's master with a worker, running a short swarm against the api with no
   failure; a worker that exits (killed) restarted by its restart policy and serving again;
   two hf workers (`--scale worker=2`) sharing jobs; a job queued while no worker runs, then
   `docker compose down` and `up`: done after (Redis's volume keeps it);
4. tears everything down, containers and volumes (`down -v`), also when a check fails or the
   run is interrupted. The images stay, so that the next run builds from cache.

Prints each step's time; exits 1 at the first failed check, after the services' logs.
Its compose project: scripts/compose_stack.py; its build settings: scripts/compose_build.py.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from scripts.compose_build import (  # noqa: F401 (serve_local, start_wheel_server: tests/test_compose.py)
    PIP_KEYS,
    TORCH_INDEX_DEFAULT,
    WHEELS_PORT,
    CheckFailed,
    build_settings,
    dotenv,
    say,
    serve_local,
    start_wheel_server,
)
from scripts.compose_stack import MIN_COMPOSE, PROFILES, PROJECT, ROOT, SLOW, Stack, compose_version, override_file

HF_IMAGE, VLLM_IMAGE = "genqueue:latest", "genqueue-vllm:latest"
# The docs' names (docs/deploying.md): the default model and its vLLM worker's.
HF_MODEL, VLLM_MODEL = "smollm2-135m-instruct", "smollm2-135m-instruct-vllm"
QUESTION, ANSWER = "What is the capital of France?", "Paris"


# --------------------------------------------------------------------------- the checks


class Api:
    def __init__(self, base: str, key: str):
        self.http = httpx.Client(base_url=base, timeout=120)
        self.key = key

    def headers(self, key: str | None = "own") -> dict[str, str]:
        key = self.key if key == "own" else key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def submit(self, body: dict, key: str | None = "own") -> httpx.Response:
        return self.http.post("/v1/jobs", json=body, headers=self.headers(key))

    def job(self, body: dict) -> str:
        r = self.submit(body)
        if r.status_code != 202:
            raise CheckFailed(f"POST /v1/jobs {body}: {r.status_code} {r.text}")
        return r.json()["id"]

    def wait(self, job_id: str, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            r = self.http.get(f"/v1/jobs/{job_id}", params={"wait": 30}, headers=self.headers(), timeout=60)
            if r.status_code != 200:
                raise CheckFailed(f"GET /v1/jobs/{job_id}: {r.status_code} {r.text}")
            rec = r.json()
            if rec["status"] not in ("queued", "running"):
                return rec
            if time.monotonic() > deadline:
                raise CheckFailed(f"job {job_id} still {rec['status']} after {timeout:.0f} s")

    def succeeded(self, body: dict, timeout: float = 180) -> dict:
        rec = self.wait(self.job(body), timeout)
        if rec["status"] != "succeeded":
            raise CheckFailed(f"job {body} ended {rec['status']}: {rec.get('error')}")
        return rec


def check_keys(api: Api) -> None:
    body = {"prompt": "Hello", "max_new_tokens": 4}
    for key, what in ((None, "no key"), ("sk-wrong", "a wrong key")):
        r = api.submit(body, key=key)
        if r.status_code != 401:
            raise CheckFailed(f"POST /v1/jobs with {what}: {r.status_code}, not 401")
    r = api.http.get("/healthz")
    if r.status_code != 200:
        raise CheckFailed(f"/healthz needs no key: got {r.status_code}")
    say("  401 without a key and with a wrong one; /healthz open")


def check_models(api: Api) -> None:
    for model, engine in ((HF_MODEL, "hf"), (VLLM_MODEL, "vllm")):
        rec = api.succeeded({"prompt": "Hello, my name is", "max_new_tokens": 8, "model": model})
        if rec["model"] != model or f"genq-{engine}-" not in (rec.get("worker") or ""):
            raise CheckFailed(f"a job for {model!r} ran as {rec['model']!r} on {rec.get('worker')!r}")
        say(f"  {model!r}: succeeded on {rec['worker']} ({rec['result']['completion_tokens']} tokens)")
    rec = api.succeeded({"prompt": "Hello", "max_new_tokens": 4})
    if rec["model"] != HF_MODEL:
        raise CheckFailed(f"a job without a model went to {rec['model']!r}, not {HF_MODEL!r}")
    r = api.http.post(
        "/v1/completions", json={"model": VLLM_MODEL, "prompt": "Hello", "max_tokens": 8}, headers=api.headers()
    )
    if r.status_code != 200 or r.json().get("model") != VLLM_MODEL:
        raise CheckFailed(f"/v1/completions for {VLLM_MODEL!r}: {r.status_code} {r.text[:300]}")
    say(f"  a job without a model: {HF_MODEL!r}; /v1/completions for {VLLM_MODEL!r}: 200")
    for model in (HF_MODEL, VLLM_MODEL):  # the real model, through its chat template, greedy
        body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 32, "temperature": 0}
        r = api.http.post("/v1/chat/completions", json=body, headers=api.headers())
        answer = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else ""
        if ANSWER not in (answer or ""):
            raise CheckFailed(f"{model!r} asked {QUESTION!r}: {r.status_code} {r.text[:300]}")
        say(f"  {model!r}: {QUESTION!r} -> {answer!r}")


def check_flower(stack: Stack, auth: str) -> None:
    base = f"http://127.0.0.1:{stack.port('flower', 5555)}"
    user, _, password = auth.partition(":")
    if (code := httpx.get(base + "/", timeout=30).status_code) != 401:
        raise CheckFailed(f"Flower without its basic auth: {code}, not 401")
    if (code := httpx.get(base + "/", auth=(user, password), timeout=30).status_code) != 200:
        raise CheckFailed(f"Flower with its basic auth: {code}, not 200")
    say("  Flower: 401 without its basic auth, 200 with it")


def check_locust(stack: Stack, seconds: float = 15) -> None:
    """The master sees its worker; one user for a while: requests through the api, none failed."""
    base = f"http://127.0.0.1:{stack.port('locust', 8089)}"
    stats = httpx.get(base + "/stats/requests", timeout=30).json()
    if stats.get("worker_count", 0) < 1:
        raise CheckFailed(f"locust's master has no worker: {stats.get('workers')}\n{stack.logs('locust-worker')}")
    form = {"user_count": "1", "spawn_rate": "1", "host": "http://api:8000"}
    r = httpx.post(base + "/swarm", data=form, timeout=30)
    if r.status_code != 200 or not r.json().get("success"):
        raise CheckFailed(f"locust /swarm: {r.status_code} {r.text[:300]}")
    try:
        deadline = time.monotonic() + seconds + 60
        while True:
            time.sleep(2)
            stats = httpx.get(base + "/stats/requests", timeout=30).json()
            total = next(s for s in stats["stats"] if s["name"] == "Aggregated")
            if total["num_failures"]:
                raise CheckFailed(f"locust: {total['num_failures']} failed requests: {stats['errors'][:3]}")
            if total["num_requests"] >= 4 and time.monotonic() > deadline - 60:
                break
            if time.monotonic() > deadline:
                raise CheckFailed(f"locust: {total['num_requests']} requests in {seconds + 60:.0f} s")
    finally:
        httpx.get(base + "/stop", timeout=30)
    say(f"  locust: master + {stats['worker_count']} worker, {total['num_requests']} requests, none failed")


def worker_containers(stack: Stack, service: str) -> list[dict]:
    return [c for c in stack.containers() if c["Service"] == service and c["State"] == "running"]


def check_restart(stack: Stack, api: Api, timeout: float) -> None:
    """Kill the hf worker's process (SIGKILL from the host, as the OOM killer would; where this
    user may not signal it, SIGQUIT from inside: Celery's cold shutdown, exit 1). Its restart
    policy brings it back, healthy, and it serves a job."""
    (c,) = worker_containers(stack, "worker")
    info = stack.inspect(c["ID"])
    before = info["RestartCount"]
    try:
        os.kill(info["State"]["Pid"], signal.SIGKILL)
        how = "SIGKILL from the host"
    except PermissionError:
        stack.run("exec", "-T", "worker", "python", "-c", "import os, signal; os.kill(1, signal.SIGQUIT)")
        how = "SIGQUIT from inside"
    t0 = time.monotonic()
    while stack.inspect(c["ID"])["RestartCount"] == before:
        if time.monotonic() - t0 > 60:
            raise CheckFailed(f"the worker was not restarted within 60 s ({how}):\n{stack.logs('worker')}")
        time.sleep(1)
    took = stack.wait_healthy({"worker": 1}, timeout, restarting_ok=True)
    rec = api.succeeded({"prompt": "Hello again", "max_new_tokens": 4, "model": HF_MODEL})
    say(f"  worker killed ({how}): restarted, healthy again {took:.0f} s later, served {rec['id']}")


def check_two_workers(stack: Stack, api: Api, timeout: float, jobs: int = 16) -> None:
    stack.run("up", "-d", "--no-recreate", "--scale", "worker=2", timeout=SLOW)
    took = stack.wait_healthy({"worker": 2}, timeout)
    body = {"prompt": "Two workers share", "max_new_tokens": 32, "model": HF_MODEL, "ignore_eos": True}
    ids = [api.job(body) for _ in range(jobs)]
    with ThreadPoolExecutor(8) as pool:
        recs = list(pool.map(api.wait, ids))
    failed = [r for r in recs if r["status"] != "succeeded"]
    if failed:
        raise CheckFailed(f"{len(failed)} of {jobs} jobs failed: {failed[0].get('error')}")
    by_worker: dict[str, int] = {}
    for rec in recs:
        by_worker[rec["worker"]] = by_worker.get(rec["worker"], 0) + 1
    if len(by_worker) < 2:
        raise CheckFailed(f"--scale worker=2: every job ran on one worker: {by_worker}")
    say(f"  --scale worker=2: second worker healthy in {took:.0f} s; {jobs} jobs split {sorted(by_worker.values())}")


def check_survives_down(stack: Stack, api: Api, timeout: float) -> float:
    """A job queued while no worker runs is done after `down` and `up` of the default stack
    (Redis's volume). Returns the seconds from this `up -d` to every service healthy."""
    stack.run("stop", "worker", "vllm-worker")
    job_id = api.job({"prompt": "Queued before down", "max_new_tokens": 4, "model": HF_MODEL})
    r = api.http.get(f"/v1/jobs/{job_id}", headers=api.headers())
    if r.json()["status"] != "queued":
        raise CheckFailed(f"with no worker the job is {r.json()['status']}, not queued")
    stack.run("down", timeout=SLOW)
    say(f"  `down` took {stack.took:.0f} s; `up -d` of the default stack")
    took = stack.up(timeout, profiles=())
    again = Api(f"http://127.0.0.1:{stack.port('api', 8000)}", api.key)  # a new host port
    rec = again.wait(job_id)
    if rec["status"] != "succeeded":
        raise CheckFailed(f"the job queued before `down` ended {rec['status']}: {rec.get('error')}")
    say(f"  a job queued before `down` succeeded after `up` ({took:.0f} s from `up -d` to healthy)")
    return took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.compose_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-build", action="store_true", help="use the images built last time")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the stack to become healthy")
    args = parser.parse_args(argv)

    if not shutil.which("docker"):
        say(
            "no `docker` command: install Docker with Compose v2 (on the development machines: ../shared/tools/docker-here)"
        )
        return 2
    version = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True, text=True)
    if version.returncode != 0:
        say(f"`docker compose` (v2) is missing: {version.stderr.strip()}")
        return 2
    if compose_version(version.stdout) < MIN_COMPOSE:
        say(f"compose {version.stdout.strip()} is older than {'.'.join(map(str, MIN_COMPOSE))} (`!override`)")
        return 2
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        say("the Docker engine does not answer (`docker info`)")
        return 2

    workdir = Path(tempfile.mkdtemp(prefix="genq-compose-check-"))
    (workdir / "empty.env").write_text("")
    key = "sk-check-" + secrets.token_hex(16)
    flower_auth = "check:" + secrets.token_hex(8)
    # The defaults are what is checked: no GENQ_* of this shell reaches the stack.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GENQ_", "COMPOSE_", "FLOWER_", *PIP_KEYS))}
    env.update(GENQ_API_KEYS=key, GENQ_API_KEY=key, FLOWER_BASIC_AUTH=flower_auth)

    server, stack, passed = None, None, False
    times: dict[str, float] = {}
    # `make` stopped (SIGTERM) cleans up as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        raw = {} if args.no_build else build_settings(os.environ)
        settings, served = serve_local(raw, WHEELS_PORT)
        if served:
            server, port = start_wheel_server(served)
            if port != WHEELS_PORT:  # taken: the same folders, in the same order, on another port
                settings, _ = serve_local(raw, port)
            say(f"serving {', '.join(str(p) for p in served.values())} on 127.0.0.1:{port} for the builds")
        env.update(settings)
        override_file(workdir / "override.yml", host_network_builds=bool(served))
        stack = Stack(workdir, env, [ROOT / "docker-compose.yml", workdir / "override.yml"])
        say(f"compose {version.stdout.strip()}, project {PROJECT}, logs in {workdir}")
        stack.run("down", "-v", "--remove-orphans", timeout=SLOW)  # what an interrupted run left

        if not args.no_build:
            for service, image in (("api", HF_IMAGE), ("vllm-worker", VLLM_IMAGE)):
                say(f"building {image} (service {service}) ...")
                t0 = time.monotonic()
                stack.build(service, workdir / f"build-{service}.log")
                times[f"build {image}"] = time.monotonic() - t0
                say(f"  built in {times[f'build {image}']:.0f} s")
        for image in (HF_IMAGE, VLLM_IMAGE):
            size = subprocess.run(
                ["docker", "image", "inspect", "-f", "{{.Size}}", image], capture_output=True, text=True
            )
            if size.returncode != 0:
                raise CheckFailed(f"no image {image}: build it (drop --no-build)")
            say(f"  {image}: {int(size.stdout) / 1e9:.2f} GB")

        say(f"docker compose --profile {' --profile '.join(PROFILES)} up -d")
        times["up -d to healthy (every profile)"] = took = stack.up(args.timeout)
        say(f"  every service healthy {took:.0f} s after `up -d`")
        api = Api(f"http://127.0.0.1:{stack.port('api', 8000)}", key)

        say("API keys")
        check_keys(api)
        say("a job on each engine by the docs' model names")
        check_models(api)
        say("Flower")
        check_flower(stack, flower_auth)
        say("locust")
        check_locust(stack)
        say("a worker that exits")
        check_restart(stack, api, args.timeout)
        say("two workers")
        check_two_workers(stack, api, args.timeout)
        say("a job queued before `down`")
        times["up -d to healthy (default stack, after down)"] = check_survives_down(stack, api, args.timeout)
        say("PASSED: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))
        passed = True
        return 0
    except CheckFailed as e:
        say(f"FAILED: {e}")
        return 1
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finally:
        if server is not None:
            server.shutdown()
        if stack is not None:
            say("docker compose down -v")
            try:
                stack.run("down", "-v", "--remove-orphans", timeout=SLOW, check=False)
                say(f"  removed in {stack.took:.0f} s")
            except CheckFailed as e:
                say(f"{e}: run `docker compose -p {PROJECT} down -v` to remove what is left")
                passed = False
        if passed:  # the logs of a failed run stay, for reading
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
