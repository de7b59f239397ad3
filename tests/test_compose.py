"""Static checks of docker-compose.yml, Dockerfile and .dockerignore.

Docker itself is not needed: the compose file is parsed with PyYAML (merge keys and
anchors resolved) and variables are interpolated the way compose does with an empty
environment, i.e. what `docker compose up` sees with no .env file.  When a compose
client happens to be installed, `config -q` is run as an extra check.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"

if str(REPO_ROOT) not in sys.path:  # so `scripts.stack` imports however pytest is run
    sys.path.insert(0, str(REPO_ROOT))

APP_SERVICES = ("model-init", "worker", "api")
TINY_MODEL_PATH = "/models/tiny-opt"
API_PORT = 8000


# --------------------------------------------------------------------------- helpers

_INTERPOLATION = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<invalid>))"
)


def interpolate(value, env: dict[str, str] | None = None):
    """Resolve compose variable interpolation (``$$``, ``$VAR``, ``${VAR}``,
    ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?err}``, ``${VAR:+alt}``)."""
    env = {} if env is None else env
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def repl(m: re.Match) -> str:
        if m.group("escaped"):
            return "$"
        if m.group("named"):
            return env.get(m.group("named"), "")
        if m.group("braced"):
            name, op, arg = m.group("braced"), m.group("op"), m.group("arg")
            val = env.get(name)
            if op is None:
                return val or ""
            empty_counts = op.startswith(":")
            is_set = val is not None and (val != "" or not empty_counts)
            kind = op[-1]
            if kind == "-":
                return val if is_set else arg
            if kind == "+":
                return arg if is_set else ""
            if not is_set:  # "?"
                raise AssertionError(f"required variable {name} is unset: {arg}")
            return val
        raise AssertionError(f"invalid interpolation in {value!r} (use $$ for a literal $)")

    return _INTERPOLATION.sub(repl, value)


def argv(command) -> list[str]:
    """A compose command/test as argv, whether written as a list or a string."""
    if command is None:
        return []
    if isinstance(command, str):
        return shlex.split(command)
    return [str(part) for part in command]


def same_program(a: str, b: str) -> bool:
    """`python` vs `/path/to/.venv/bin/python3.11`, `gunicorn` vs `.venv/bin/gunicorn`."""
    a, b = os.path.basename(a), os.path.basename(b)
    if a == b:
        return True
    python = re.compile(r"python(\d+(\.\d+)?)?")
    return bool(python.fullmatch(a) and python.fullmatch(b))


def env_of(service: dict) -> dict:
    env = service.get("environment") or {}
    if isinstance(env, list):  # ["KEY=value", "KEY"]
        parsed = {}
        for item in env:
            key, sep, val = str(item).partition("=")
            parsed[key] = val if sep else None
        env = parsed
    return {k: interpolate(v) for k, v in env.items()}


def depends_on(service: dict) -> dict:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):  # short syntax: no conditions at all
        return {name: {"condition": "service_started"} for name in deps}
    return deps


def published_ports(service: dict) -> list[tuple[str | None, int]]:
    """(published, target) pairs for short ("[ip:]host:container[/proto]") and long syntax."""
    pairs = []
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            pub = port.get("published")
            pairs.append((None if pub is None else str(pub), int(port["target"])))
            continue
        spec = str(interpolate(port)).split("/")[0]
        parts = spec.rsplit(":", 2)
        if len(parts) == 1:
            pairs.append((None, int(parts[0])))
        else:
            pairs.append((parts[-2], int(parts[-1])))
    return pairs


def volume_mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """target -> (source, read_only)."""
    mounts = {}
    for vol in service.get("volumes") or []:
        if isinstance(vol, dict):
            mounts[vol["target"]] = (vol.get("source"), bool(vol.get("read_only")))
            continue
        parts = str(vol).split(":")
        if len(parts) == 1:
            mounts[parts[0]] = (None, False)
        else:
            mode = parts[2] if len(parts) > 2 else ""
            mounts[parts[1]] = (parts[0], "ro" in mode.split(","))
    return mounts


@pytest.fixture(scope="module")
def compose() -> dict:
    assert COMPOSE_FILE.is_file(), "docker-compose.yml is missing"
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


@pytest.fixture(scope="module")
def stack_commands():
    from scripts.stack import API_COMMAND, WORKER_COMMAND

    return list(API_COMMAND), list(WORKER_COMMAND)


# --------------------------------------------------------------------------- compose


def test_compose_parses_with_expected_services(compose, services):
    assert set(services) >= {"redis", *APP_SERVICES}
    # The file must be valid YAML for compose too: no leftover unresolved merge keys.
    for name, svc in services.items():
        assert isinstance(svc, dict), name
        assert "<<" not in svc, name


def test_every_service_has_image_or_build(services):
    for name, svc in services.items():
        assert svc.get("image") or svc.get("build"), f"{name} has neither image nor build"


def test_app_services_share_one_image_built_from_dockerfile(services):
    images = {svc.get("image") for name, svc in services.items() if name in APP_SERVICES}
    assert len(images) == 1, f"api, worker and model-init should share one image: {images}"
    for name in APP_SERVICES:
        build = services[name].get("build")
        assert build, f"{name} must build the image (so `docker compose up --build` works)"
        if isinstance(build, str):
            build = {"context": build}
        context = REPO_ROOT / build.get("context", ".")
        assert (context / build.get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE


def test_shared_environment_is_an_x_extension(compose, services):
    extensions = {k: v for k, v in compose.items() if k.startswith("x-")}
    shared = [v for v in extensions.values() if isinstance(v, dict) and "REDIS_URL" in v]
    assert shared, "expected an x- extension (YAML anchor) holding the shared environment"
    for name in ("api", "worker"):
        env = services[name].get("environment") or {}
        missing = set(shared[0]) - set(env)
        assert not missing, f"{name} does not use the shared environment: missing {missing}"


def test_redis_is_persistent_and_healthchecked(compose, services):
    redis = services["redis"]
    assert str(redis["image"]).split(":")[0] in {"redis", "docker.io/library/redis"}
    assert str(redis["image"]).split(":")[1].startswith("7")
    cmd = argv(redis.get("command"))
    assert "--appendonly" in cmd, cmd
    assert cmd[cmd.index("--appendonly") + 1] == "yes", cmd

    test = argv(redis["healthcheck"]["test"])
    assert test[0] in {"CMD", "CMD-SHELL"}
    assert "redis-cli" in " ".join(test[1:]) and "ping" in " ".join(test[1:]), test

    mounts = volume_mounts(redis)
    assert "/data" in mounts, "redis data must live on a volume"
    assert mounts["/data"][0] in (compose.get("volumes") or {}), "expected a named volume for /data"


def test_api_command_matches_stack(services, stack_commands):
    api_command, _ = stack_commands
    got = argv(services["api"]["command"])
    assert got and same_program(got[0], api_command[0]), (got, api_command)
    assert got[1:] == list(api_command[1:]), (got, api_command)
    assert got == ["gunicorn", "--config", "python:webapp.gunicorn_conf", "webapp:create_app()"]


def test_worker_command_matches_stack(services, stack_commands):
    _, worker_command = stack_commands
    got = argv(services["worker"]["command"])
    assert got and same_program(got[0], worker_command[0]), (got, worker_command)
    assert got[1:] == list(worker_command[1:]), (got, worker_command)


def test_depends_on_conditions(services):
    worker = depends_on(services["worker"])
    assert worker["redis"]["condition"] == "service_healthy"
    assert worker["model-init"]["condition"] == "service_completed_successfully"
    api = depends_on(services["api"])
    assert api["redis"]["condition"] == "service_healthy"
    # Every service depended on for health must define a healthcheck.
    for name, svc in services.items():
        for dep, spec in depends_on(svc).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            if spec.get("condition") == "service_healthy":
                assert services[dep].get("healthcheck"), f"{dep} has no healthcheck"


def test_model_init_is_one_shot(services):
    restart = str(services["model-init"].get("restart", "no"))
    assert restart in {"no", "False", "false"}, "a restarting model-init never completes"


def test_api_publishes_port_and_binds_all_interfaces(services):
    api = services["api"]
    assert ("8000", API_PORT) in published_ports(api), published_ports(api)
    env = env_of(api)
    assert env["GENQ_HOST"] == "0.0.0.0"
    assert int(env.get("GENQ_PORT") or API_PORT) == API_PORT


def test_api_healthcheck_uses_python_urllib_on_healthz(services):
    hc = services["api"]["healthcheck"]
    test = argv(hc["test"])
    assert test[0] in {"CMD", "CMD-SHELL"}
    joined = " ".join(test[1:])
    assert "python" in joined and "urllib" in joined, "slim images have no curl/wget"
    assert "curl" not in joined and "wget" not in joined
    assert f":{API_PORT}/healthz" in joined
    if test[0] == "CMD" and "-c" in test:  # the inline script must at least compile
        compile(test[test.index("-c") + 1], "<healthcheck>", "exec")


def test_api_and_worker_share_redis_and_model(services):
    api, worker = env_of(services["api"]), env_of(services["worker"])
    assert api["REDIS_URL"] == worker["REDIS_URL"]
    url = urlparse(api["REDIS_URL"])
    assert url.scheme == "redis"
    assert url.hostname == "redis" and "redis" in services
    assert (url.port or 6379) == 6379
    # The api routes jobs to the queue of the model the worker serves.
    assert api.get("GENQ_MODEL") == worker.get("GENQ_MODEL") == TINY_MODEL_PATH
    assert api.get("GENQ_MODEL_NAME") == worker.get("GENQ_MODEL_NAME")


def test_environment_values_are_strings(services):
    # Compose rejects YAML booleans in `environment` (write "1"/"true" quoted).
    for name, svc in services.items():
        env = svc.get("environment") or {}
        if isinstance(env, dict):
            for key, val in env.items():
                assert val is None or isinstance(val, (str, int, float)), (name, key, val)
                assert not isinstance(val, bool), (name, key, val)


def test_model_volume_is_shared_and_built_by_model_init(compose, services):
    declared = compose.get("volumes") or {}
    init_src, init_ro = volume_mounts(services["model-init"])["/models"]
    worker_src, _ = volume_mounts(services["worker"])["/models"]
    assert init_src == worker_src == "models"
    assert "models" in declared
    assert not init_ro, "model-init must be able to write the models volume"

    script = " ".join(interpolate(argv(services["model-init"]["command"])))
    assert f"worker.devmodels --shape tiny --out {TINY_MODEL_PATH}" in script
    # The shell (not compose) must see $GENQ_MODEL: i.e. it was escaped as $$ in the file.
    assert "$GENQ_MODEL" in script or "${GENQ_MODEL}" in script
    assert TINY_MODEL_PATH in env_of(services["model-init"]).get("GENQ_MODEL", "")


def test_model_init_script_only_builds_when_model_is_the_tiny_one(services, tmp_path):
    """Run model-init's shell script with a stub `python` to check the branch logic."""
    cmd = interpolate(argv(services["model-init"]["command"]))
    assert cmd and cmd[0] in {"sh", "/bin/sh", "bash", "/bin/bash"} and "-c" in cmd
    sh = shutil.which("sh")
    assert sh is not None
    stub = tmp_path / "python"
    stub.write_text('#!/bin/sh\necho "PYTHON $*"\n')
    stub.chmod(0o755)
    script = cmd[cmd.index("-c") + 1]

    def run(model: str) -> str:
        env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}", "GENQ_MODEL": model}
        proc = subprocess.run([sh, "-c", script], env=env, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert f"PYTHON -m worker.devmodels --shape tiny --out {TINY_MODEL_PATH}" in run(TINY_MODEL_PATH)
    assert "PYTHON" not in run("facebook/opt-125m")


# --------------------------------------------------------------------------- Dockerfile


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text()
    text = re.sub(r"\\\n", " ", text)  # join continuation lines
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile_base_user_and_cmd(stack_commands):
    assert DOCKERFILE.is_file(), "Dockerfile is missing"
    instr = _dockerfile_instructions()
    froms = [rest for op, rest in instr if op == "FROM"]
    assert froms and froms[-1].split()[0] == "python:3.11-slim"

    users = [rest for op, rest in instr if op == "USER"]
    assert users, "the image must drop root"
    assert users[-1].split(":")[0] not in {"root", "0"}

    cmds = [rest for op, rest in instr if op == "CMD"]
    entrypoints = [rest for op, rest in instr if op == "ENTRYPOINT"]
    assert not entrypoints, "compose overrides `command`; an ENTRYPOINT would wrap it"
    assert cmds, "expected a default CMD"
    cmd = json.loads(cmds[-1])  # exec (JSON) form, so signals reach gunicorn directly
    api_command, worker_command = stack_commands
    assert cmd in (list(api_command), list(worker_command)) or cmd == [
        "gunicorn",
        "--config",
        "python:webapp.gunicorn_conf",
        "webapp:create_app()",
    ]


def test_dockerfile_installs_cpu_torch_then_requirements_and_downloads_no_model():
    instr = _dockerfile_instructions()
    runs = " \n".join(rest for op, rest in instr if op == "RUN")
    assert "download.pytorch.org/whl/cpu" in runs, "torch must come from the CPU wheel index"
    assert "requirements" in runs
    assert runs.index("download.pytorch.org/whl/cpu") < runs.index("-r ")
    for forbidden in ("devmodels", "from_pretrained", "snapshot_download", "hf download", "huggingface-cli"):
        assert forbidden not in runs, f"no model download/build at image build time ({forbidden})"

    copies = [(i, rest) for i, (op, rest) in enumerate(instr) if op in {"COPY", "ADD"}]
    assert any("requirements.txt" in rest for _, rest in copies)
    assert any(rest.split()[-2:] in (["."] * 2, [".", "/app"], [".", "./"]) for _, rest in copies), copies
    # /models must exist in the image, owned by the runtime user, so the named volume
    # mounted there starts out writable by model-init.
    assert "/models" in runs and "chown" in runs


def test_dockerignore_keeps_context_small():
    assert DOCKERIGNORE.is_file()
    patterns = {
        line.strip().rstrip("/").lstrip("/")
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    }
    assert {".git", ".venv"} <= patterns
    assert "requirements.txt" not in patterns
    for package in ("webapp", "worker", "tasks", "scripts"):
        assert package not in patterns
