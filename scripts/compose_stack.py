"""`make test-compose`'s compose project (scripts/compose_check.py).

The stack runs as its own compose project (`genq-compose-check`), with the project's `.env`
left out (`--env-file` of its own: the check tests the defaults) and the host ports chosen
free (an override file: nothing collides with a stack already on 8000).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from scripts.compose_build import ROOT, CheckFailed, say

PROJECT = "genq-compose-check"
PROFILES = ("vllm", "locust", "flower")
# Every service of the default stack and the profiles, and how many containers each.
EXPECT = {
    "redis": 1,
    "model-init": 1,
    "api": 1,
    "worker": 1,
    "vllm-worker": 1,
    "flower": 1,
    "locust": 1,
    "locust-worker": 1,
}
DEFAULT_SERVICES = ("redis", "model-init", "api", "worker")
# `up` and `down` on a loaded machine with Docker's vfs storage driver (docker-here's), which
# copies an image whole for each container and deletes that copy on `down`: minutes.
SLOW = 1800
# The override file's `!override` tag (the free host ports) is compose's since 2.24.4.
MIN_COMPOSE = (2, 24, 4)


# --------------------------------------------------------------------------- compose


class Stack:
    """`docker compose` for the check's own project: its files, its environment, its logs."""

    def __init__(self, workdir: Path, env: dict[str, str], files: list[Path]):
        self.workdir, self.env, self.files = workdir, env, files
        self.log = workdir / "compose.log"
        self.took = 0.0  # how long the last command took

    def argv(self, *args: str, profiles: tuple[str, ...] = PROFILES) -> list[str]:
        out = ["docker", "compose", "--project-directory", str(ROOT), "-p", PROJECT]
        out += ["--env-file", str(self.workdir / "empty.env")]
        for f in self.files:
            out += ["-f", str(f)]
        for p in profiles:
            out += ["--profile", p]
        return out + list(args)

    def run(
        self, *args: str, timeout: float = 300, check: bool = True, profiles: tuple[str, ...] = PROFILES
    ) -> subprocess.CompletedProcess:
        """Run a compose command; its output goes to the log (and to the error when it fails)."""
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                self.argv(*args, profiles=profiles), env=self.env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as e:
            raise CheckFailed(f"docker compose {' '.join(args)} did not finish within {timeout:.0f} s") from e
        self.took = time.monotonic() - t0
        with self.log.open("a") as f:
            f.write(f"$ docker compose {' '.join(args)}   ({self.took:.1f} s)\n{proc.stdout}{proc.stderr}\n")
        if check and proc.returncode != 0:
            raise CheckFailed(
                f"docker compose {' '.join(args)} exited {proc.returncode}:\n{tail(proc.stdout + proc.stderr)}"
            )
        return proc

    def build(self, service: str, log: Path) -> None:
        with log.open("w") as out:
            proc = subprocess.run(
                self.argv("build", "--progress", "plain", service), env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        if proc.returncode != 0:
            raise CheckFailed(f"building {service} failed (exit {proc.returncode}):\n{tail(log.read_text(), 40)}")

    def containers(self) -> list[dict]:
        """Every container of the project, running or not (`docker compose ps -a`)."""
        out = self.run("ps", "-a", "--format", "json").stdout.strip()
        if not out:
            return []
        if out.startswith("["):  # compose < 2.21: one JSON array
            return json.loads(out)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def inspect(self, container: str) -> dict:
        proc = subprocess.run(["docker", "inspect", container], capture_output=True, text=True, check=True)
        return json.loads(proc.stdout)[0]

    def port(self, service: str, target: int) -> int:
        out = self.run("port", service, str(target)).stdout.strip()
        return int(out.rsplit(":", 1)[1])

    def logs(self, *services: str, lines: int = 60) -> str:
        return self.run("logs", "--no-color", "--tail", str(lines), *services, check=False).stdout

    def up(self, timeout: float, profiles: tuple[str, ...] = PROFILES) -> float:
        """`up -d`, then wait for every service; the seconds from `up -d` to all healthy."""
        t0 = time.monotonic()
        self.run("up", "-d", timeout=SLOW, profiles=profiles)
        say(f"  `up -d` returned after {self.took:.0f} s (it waits for the dependencies' conditions)")
        expect = {name: n for name, n in EXPECT.items() if name in DEFAULT_SERVICES or profiles}
        self.wait_healthy(expect, timeout)
        return time.monotonic() - t0

    def wait_healthy(self, expect: dict[str, int], timeout: float, restarting_ok: bool = False) -> float:
        """Wait until each service has `expect[service]` containers healthy (no healthcheck:
        running; model-init: exited 0). Returns the seconds it took; fails at once on a
        container that exited or restarts (crash-loops), unless `restarting_ok`."""
        t0 = time.monotonic()
        last = ""
        while True:
            state: dict[str, list[str]] = {}
            for c in self.containers():
                name, status = c["Service"], c.get("State", "")
                health = c.get("Health", "")
                if name == "model-init":
                    if status == "exited" and c.get("ExitCode", 0) != 0:
                        raise CheckFailed(f"model-init exited {c['ExitCode']}:\n{self.logs('model-init')}")
                    state.setdefault(name, []).append("done" if status == "exited" else status)
                    continue
                if status in ("exited", "dead") or (status == "restarting" and not restarting_ok):
                    raise CheckFailed(f"{c['Name']} is {status} ({c.get('Status')}):\n{self.logs(name)}")
                ok = status == "running" and health in ("healthy", "")
                state.setdefault(name, []).append("ok" if ok else health or status)
            done = all(state.get(s, []).count("ok") >= n for s, n in expect.items() if s != "model-init")
            done = done and "done" in state.get("model-init", [])
            now = " ".join(f"{s}={','.join(v)}" for s, v in sorted(state.items()))
            if now != last:
                say(f"  {time.monotonic() - t0:5.0f} s  {now}")
                last = now
            if done:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                unhealthy = [s for s, v in state.items() if any(x not in ("ok", "done") for x in v)]
                raise CheckFailed(f"not healthy after {timeout:.0f} s: {now}\n{self.logs(*unhealthy)}")
            time.sleep(2)


def compose_version(text: str) -> tuple[int, ...]:
    """`2.26.1-4`, `v2.24.4-desktop.1` -> (2, 26, 1)."""
    parts = []
    for part in text.strip().lstrip("v").split("-")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def override_file(path: Path, host_network_builds: bool) -> None:
    """Ports on free host ports (127.0.0.1, chosen by Docker) instead of 8000/5555/8089, and the
    builds on the host's network when they fetch wheels from this host's HTTP server."""
    text = "services:\n"
    for service, target in (("api", 8000), ("flower", 5555), ("locust", 8089)):
        text += f'  {service}:\n    ports: !override\n      - "127.0.0.1::{target}"\n'
        if host_network_builds and service == "api":
            text += "    build:\n      network: host\n"
    if host_network_builds:
        text += "  vllm-worker:\n    build:\n      network: host\n"
    path.write_text(text)
