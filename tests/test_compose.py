"""Static checks of docker-compose.yml, the Dockerfiles and .dockerignore.

Docker itself is not needed: the compose file is parsed with PyYAML (merge keys and
anchors resolved) and variables are interpolated the way compose does (nested defaults
included) with an empty environment, i.e. what `docker compose up` sees with no .env file,
or with the settings a test gives. `make test-compose` (scripts/compose_check.py) builds the
images and checks the stack running, where a Docker engine is.
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

pytestmark = pytest.mark.tooling  # the project's tooling, not the product: `make test-core` skips it

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "Dockerfile"
# The image's Python is the one the tests run on (python:3.11-slim for 3.11).
TESTED_PYTHON = f"python:{sys.version_info.major}.{sys.version_info.minor}-"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"

if str(REPO_ROOT) not in sys.path:  # so `scripts.stack` imports however pytest is run
    sys.path.insert(0, str(REPO_ROOT))

APP_SERVICES = ("model-init", "worker", "api")
TINY_MODEL_PATH = "/models/tiny-opt"
DEFAULT_MODEL_PATH = "/models/smollm2-135m-instruct"  # SmolLM2-135M-Instruct, as `make run` serves
API_PORT = 8000


# --------------------------------------------------------------------------- helpers

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def interpolate(value, env: dict[str, str] | None = None):
    """Resolve compose variable interpolation (``$$``, ``$VAR``, ``${VAR}``,
    ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?err}``, ``${VAR:+alt}``), defaults
    nested as compose v2 nests them (``${A:-${B:-x}-vllm}``)."""
    env = {} if env is None else env
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value
    out, rest = _substitute(value, env, inside=False)
    assert not rest, f"unbalanced braces in {value!r}"
    return out


def _substitute(text: str, env: dict[str, str], inside: bool) -> tuple[str, str]:
    """Interpolate `text` up to its end, or (inside a default) up to the `}` that closes it;
    returns the result and what follows that brace (with it)."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if inside and c == "}":
            return "".join(out), text[i:]
        if c != "$":
            out.append(c)
            i += 1
            continue
        nxt = text[i + 1 : i + 2]
        if nxt == "$":
            out.append("$")
            i += 2
            continue
        if nxt != "{":
            m = _NAME.match(text, i + 1)
            assert m, f"invalid interpolation in {text!r} (use $$ for a literal $)"
            out.append(env.get(m.group(), ""))
            i = m.end()
            continue
        m = _NAME.match(text, i + 2)
        assert m, f"invalid interpolation in {text!r}"
        name, val, j = m.group(), env.get(m.group()), m.end()
        op = next((o for o in (":-", ":+", ":?", "-", "+", "?") if text.startswith(o, j)), None)
        arg = ""
        if op is not None:
            arg, after = _substitute(text[j + len(op) :], env, inside=True)
            j = len(text) - len(after)
        assert text[j : j + 1] == "}", f"unclosed ${{ in {text!r}"
        i = j + 1
        if op is None:
            out.append(val or "")
            continue
        is_set = val is not None and (val != "" or not op.startswith(":"))
        if op[-1] == "-":
            out.append(val if is_set else arg)
        elif op[-1] == "+":
            out.append(arg if is_set else "")
        else:  # "?"
            assert is_set, f"required variable {name} is unset: {arg}"
            out.append(val)
    assert not inside, f"unclosed ${{ in {text!r}"
    return "".join(out), ""


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


def published_ports(service: dict, env: dict[str, str] | None = None) -> list[tuple[str | None, str | None, int]]:
    """(host ip, published, target) for short ("[ip:]host:container[/proto]") and long syntax;
    no ip: every interface (compose's default)."""
    out = []
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            pub = port.get("published")
            ip = interpolate(port.get("host_ip"), env) or "0.0.0.0"
            out.append((ip, None if pub is None else str(interpolate(pub, env)), int(port["target"])))
            continue
        parts = str(interpolate(port, env)).split("/")[0].split(":")
        ip = parts[0] if len(parts) == 3 else "0.0.0.0"
        out.append((ip, parts[-2] if len(parts) > 1 else None, int(parts[-1])))
    return out


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


def test_app_services_share_one_image_built_once_from_dockerfile(services):
    """One build of the hf image: the api declares it (`docker compose up --build` builds it
    once), every other service of that image runs it as built (compose does not pull an
    image another service builds)."""
    (image,) = {svc.get("image") for name, svc in services.items() if name in APP_SERVICES}
    builders = [name for name, svc in services.items() if svc.get("build") and svc.get("image") == image]
    assert builders == ["api"], builders
    build = services["api"]["build"]
    assert (REPO_ROOT / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    users = {name for name, svc in services.items() if svc.get("image") == image}
    assert users == {*APP_SERVICES, "flower", "locust", "locust-worker"}, users


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


def test_api_listens_on_the_port_it_publishes(services):
    api = services["api"]
    assert [target for _, _, target in published_ports(api)] == [API_PORT]
    env = env_of(api)
    assert env["GENQ_HOST"] == "0.0.0.0", "inside its container, for the other containers (Prometheus)"
    assert int(env.get("GENQ_PORT") or API_PORT) == API_PORT


def test_ports_are_published_on_localhost_unless_told_otherwise(services):
    """`docker compose up` exposes nothing to the network; GENQ_BIND=0.0.0.0 (in .env) does."""
    published = {name: svc for name, svc in services.items() if svc.get("ports")}
    assert {"api", "flower", "grafana", "prometheus", "locust"} <= set(published)
    for name, svc in published.items():
        assert {ip for ip, _, _ in published_ports(svc)} == {"127.0.0.1"}, name
        assert {ip for ip, _, _ in published_ports(svc, {"GENQ_BIND": "0.0.0.0"})} == {"0.0.0.0"}, name


def test_api_keys_from_a_file_mounted_as_a_secret(compose, services):
    """GENQ_API_KEYS_FILE names a file on the host; compose mounts it as the api's secret and
    points the API at it. Without one the API gets an empty GENQ_API_KEYS_FILE: open, and it
    never reads the placeholder mounted instead."""
    from tasks.config import Settings
    from webapp.auth import load_keys

    api = services["api"]
    assert "genq_api_keys" in [s if isinstance(s, str) else s["source"] for s in api["secrets"]]
    secret = compose["secrets"]["genq_api_keys"]
    placeholder = interpolate(secret["file"])
    assert (REPO_ROOT / placeholder).is_file(), "compose refuses a secret whose file is missing"
    assert interpolate(secret["file"], {"GENQ_API_KEYS_FILE": "./keys.txt"}) == "./keys.txt"
    keyed = {k: interpolate(v, {"GENQ_API_KEYS_FILE": "./keys.txt"}) for k, v in api["environment"].items()}
    assert keyed["GENQ_API_KEYS_FILE"] == "/run/secrets/genq_api_keys"
    open_env = env_of(api)["GENQ_API_KEYS_FILE"]
    settings = Settings(api_keys_file=open_env, api_keys=None)
    assert not settings.auth_enabled and load_keys(settings) == []
    assert "GENQ_API_KEYS" in api["environment"], "or keys in clear from .env"


# Settings compose fixes for its own network; every other one reaches the containers.
FIXED = {"REDIS_URL", "GENQ_HOST", "GENQ_PORT", "GENQ_METRICS_PORT", "GENQ_METRICS_HOST"}
# make run's alone.
# make run only: compose has its own Flower service (the `flower` profile).
NOT_IN_CONTAINERS = {"GENQ_DATA_DIR", "GENQ_FLOWER", "GENQ_WORKERS"}  # compose: --scale worker=N


def test_every_setting_reaches_the_containers_from_env_or_dotenv(services):
    """Each setting of tasks/config.py is passed through (`KEY:` with no value: from the shell
    or .env when set there) or set by compose, in the api and in every worker."""
    from tasks.config import Settings

    names = {(f.validation_alias or "GENQ_" + name).upper() for name, f in Settings.model_fields.items()}
    names |= {"GENQ_LOG_LEVEL"}
    for service in ("api", "worker", "vllm-worker"):
        env = services[service]["environment"]
        missing = names - NOT_IN_CONTAINERS - set(env)
        if service != "api":
            missing -= {"GENQ_API_KEYS", "GENQ_API_KEYS_FILE", "GENQ_HOST", "GENQ_PORT"}
        else:
            missing -= {"GENQ_METRICS_PORT", "GENQ_METRICS_HOST"}
        assert not missing, f"{service}: not reachable from .env: {sorted(missing)}"
        for key, value in env.items():
            if key.startswith("GENQ_") and key not in FIXED and value is not None:
                assert "${" + key in str(value) or key in ("GENQ_ENGINE", "GENQ_MODEL_NAME", "GENQ_API_KEYS_FILE"), (
                    f"{service}: {key} is fixed at {value!r}; .env could not change it"
                )


def test_vllm_engine_settings_go_to_vllm():
    """GENQ_VLLM_GPU_MEMORY_UTILIZATION, _TENSOR_PARALLEL_SIZE and _MAX_MODEL_LEN are passed
    to vLLM's engine arguments (tests/test_vllm.py sees max_model_len reach the engine)."""
    import ast

    tree = ast.parse((REPO_ROOT / "worker/engines/vllm.py").read_text())
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "AsyncEngineArgs"]
    passed = {k.arg: ast.unparse(k.value) for k in call.keywords}
    for arg in ("gpu_memory_utilization", "tensor_parallel_size", "max_model_len"):
        assert passed.get(arg) == f"settings.vllm_{arg}", (arg, passed.get(arg))


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
    assert api.get("GENQ_MODEL") == worker.get("GENQ_MODEL") == DEFAULT_MODEL_PATH
    assert api.get("GENQ_MODEL_NAME") == worker.get("GENQ_MODEL_NAME")


def test_environment_values_are_strings(services):
    # Compose rejects YAML booleans in `environment` (write "1"/"true" quoted).
    for name, svc in services.items():
        env = svc.get("environment") or {}
        if isinstance(env, dict):
            for key, val in env.items():
                assert val is None or isinstance(val, (str, int, float)), (name, key, val)
                assert not isinstance(val, bool), (name, key, val)


def test_files_live_on_a_volume_of_the_api_not_in_redis(compose, services):
    """GENQ_FILES_DIR is set by default to where the api mounts the genq-files volume (a batch's
    output then grows no Redis); set empty in .env, files stay in Redis."""
    files_dir = env_of(services["api"])["GENQ_FILES_DIR"]
    source, read_only = volume_mounts(services["api"])[files_dir]
    assert source == "genq-files" and "genq-files" in (compose.get("volumes") or {}) and not read_only
    raw = services["api"]["environment"]["GENQ_FILES_DIR"]
    assert interpolate(raw, {"GENQ_FILES_DIR": ""}) == "" and interpolate(raw, {"GENQ_FILES_DIR": "/x"}) == "/x"
    assert f"mkdir -p /models {files_dir} " in DOCKERFILE.read_text()  # the volume starts the app user's


def test_model_volume_is_shared_and_built_by_model_init(compose, services):
    declared = compose.get("volumes") or {}
    init_src, init_ro = volume_mounts(services["model-init"])["/models"]
    worker_src, _ = volume_mounts(services["worker"])["/models"]
    assert init_src == worker_src == "models"
    assert "models" in declared
    assert not init_ro, "model-init must be able to write the models volume"

    script = " ".join(interpolate(argv(services["model-init"]["command"])))
    assert f"scripts.realmodel --out {DEFAULT_MODEL_PATH}" in script
    assert f"scripts.devmodels --shape tiny --out {TINY_MODEL_PATH}" in script
    # The shell (not compose) must see $GENQ_MODEL: i.e. it was escaped as $$ in the file.
    assert "$GENQ_MODEL" in script or "${GENQ_MODEL}" in script
    assert DEFAULT_MODEL_PATH in env_of(services["model-init"]).get("GENQ_MODEL", "")


def test_model_init_script_only_builds_a_bundled_model(services, tmp_path):
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

    assert f"PYTHON -m scripts.realmodel --out {DEFAULT_MODEL_PATH}" in run(DEFAULT_MODEL_PATH)
    assert f"PYTHON -m scripts.devmodels --shape tiny --out {TINY_MODEL_PATH}" in run(TINY_MODEL_PATH)
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
    assert froms and froms[-1].split()[0].startswith(TESTED_PYTHON), "the image runs the Python the tests ran"

    users = [rest for op, rest in instr if op == "USER"]
    assert users, "the image must drop root"
    assert users[-1].split(":")[0] not in {"root", "0"}

    cmds = [rest for op, rest in instr if op == "CMD"]
    entrypoints = [rest for op, rest in instr if op == "ENTRYPOINT"]
    assert not entrypoints, "compose overrides `command`; an ENTRYPOINT would wrap it"
    assert cmds, "expected a default CMD"
    cmd = json.loads(cmds[-1])  # exec (JSON) form, so signals reach gunicorn directly
    api_command, worker_command = stack_commands
    assert cmd in (list(api_command), list(worker_command))


def test_dockerfile_installs_cpu_torch_then_requirements_and_downloads_no_model():
    instr = _dockerfile_instructions()
    runs = " \n".join(rest for op, rest in instr if op == "RUN")
    args = dict(rest.partition("=")[::2] for op, rest in instr if op == "ARG")
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu", "torch from the CPU wheel index by default"
    assert '--index-url="$TORCH_INDEX"' in runs and "requirements" in runs
    assert runs.index("$TORCH_INDEX") < runs.index("-r ")
    assert "assert not torch.version.cuda" in runs, "a CUDA torch (e.g. TORCH_INDEX= on PyPI) stops the build"
    for forbidden in ("devmodels", "from_pretrained", "snapshot_download", "hf download", "huggingface-cli"):
        assert forbidden not in runs, f"no model download/build at image build time ({forbidden})"

    copies = [(i, rest) for i, (op, rest) in enumerate(instr) if op in {"COPY", "ADD"}]
    assert any("requirements.txt" in rest for _, rest in copies)
    assert any(rest.split()[-2:] in (["."] * 2, [".", "/app"], [".", "./"]) for _, rest in copies), copies
    # /models must exist in the image, owned by the runtime user, so the named volume
    # mounted there starts out writable by model-init.
    assert "/models" in runs and "chown" in runs


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves `path` out of the build context: the last pattern that matches
    it or a folder above it decides (`!` keeps); `*` and `?` stay within a path segment, `**`
    spans any number of them (Docker's fileutils)."""

    def regex(pattern: str) -> re.Pattern:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out)

    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        rx = regex(os.path.normpath(pattern.lstrip("!").strip("/")))
        if any(rx.fullmatch(p) for p in prefixes):
            ignored = not keep
    return ignored


def test_dockerignore_keeps_local_state_and_secrets_out_and_the_code_in():
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    # The virtualenvs (vLLM's is ~450 MB), make run's Redis AOF (prompts and results), models,
    # keys and .env files, caches, the git history.
    for path in (
        ".git/HEAD",
        ".venv/bin/python",
        ".venv-vllm/bin/python",
        ".data/redis/appendonly.aof",
        ".models/tiny-opt/config.json",
        ".env",
        "secrets/api_keys",
        "webapp/__pycache__/auth.cpython-311.pyc",
        ".pytest_cache/v/cache",
        ".hypothesis/examples",
        "bench/out/x.json",
        "in.jsonl",
    ):
        assert dockerignored(path, patterns), path
    # Whatever git ignores here is local state too.
    proc = subprocess.run(["git", "status", "--ignored", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("!! "):
            assert dockerignored(line[3:].rstrip("/"), patterns), line
    # The image needs every tracked file of the code, and its requirements.
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.split()
    needed = [f for f in tracked if f.split("/")[0] in {"webapp", "worker", "tasks", "scripts", "genqueue"}]
    needed += ["requirements.txt", "requirements-vllm.txt", "requirements-vllm-cpu.txt", "pyproject.toml"]
    assert len(needed) > 20
    assert not [f for f in needed if dockerignored(f, patterns)]


# --------------------------------------------------------------------------- profiles

DEFAULT_SERVICES = {"redis", "model-init", "worker", "api"}
PROFILES = {
    "vllm": {"vllm-worker"},
    "monitoring": {"prometheus", "grafana"},
    "locust": {"locust", "locust-worker"},
    "flower": {"flower"},
}
WORKERS = ("worker", "vllm-worker")
MONITORING = REPO_ROOT / "monitoring"
GPU_OVERRIDE = REPO_ROOT / "docker-compose.gpu.yml"
DOCKERFILE_VLLM = REPO_ROOT / "Dockerfile.vllm"


def test_default_stays_small_and_every_part_has_a_profile(services):
    unprofiled = {name for name, svc in services.items() if not svc.get("profiles")}
    assert unprofiled == DEFAULT_SERVICES, "`docker compose up` must stay the small default"
    for profile, names in PROFILES.items():
        got = {name for name, svc in services.items() if profile in (svc.get("profiles") or [])}
        assert got == names, (profile, got)
    # A service may depend only on services that run whenever it does.
    for name, svc in services.items():
        mine = set(svc.get("profiles") or [])
        for dep in depends_on(svc):
            theirs = set(services[dep].get("profiles") or [])
            assert not theirs or theirs & mine, f"{name} depends on {dep}, which its profile does not start"


def test_every_long_running_service_has_a_healthcheck(services):
    # model-init exits when done; a locust worker has no port to ask.
    for name, svc in services.items():
        if name in ("model-init", "locust-worker"):
            continue
        test = argv((svc.get("healthcheck") or {}).get("test"))
        assert test and test[0] in {"CMD", "CMD-SHELL"}, f"{name} has no healthcheck"
        if "-c" in test and "python" in test:
            compile(test[test.index("-c") + 1], f"<{name} healthcheck>", "exec")


def test_third_party_images_are_pinned(services):
    built = {svc["image"] for svc in services.values() if svc.get("build")}
    for name, svc in services.items():
        image = str(svc.get("image", ""))
        if image in built:
            continue
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin {image!r}"


def test_workers_scale_out(services):
    """`docker compose up --scale worker=N`: no fixed name, host port or hostname per container."""
    for name in WORKERS:
        svc = services[name]
        assert "container_name" not in svc and "hostname" not in svc, name
        assert not svc.get("ports"), f"{name} publishes a host port: a second replica could not start"
    for name, svc in services.items():
        assert "container_name" not in svc, f"{name}: a fixed container name blocks --scale"


def test_workers_serve_metrics_on_the_port_their_healthcheck_and_prometheus_use(services):
    scrape = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    worker_sd = [sd for sd in jobs["genq-worker"]["dns_sd_configs"]]
    api_sd = jobs["genq-api"]["dns_sd_configs"]
    assert {n for sd in api_sd for n in sd["names"]} == {"api"} and {sd["port"] for sd in api_sd} == {API_PORT}
    assert {n for sd in worker_sd for n in sd["names"]} == set(WORKERS)
    for name in WORKERS:
        env = env_of(services[name])
        port = int(env["GENQ_METRICS_PORT"])
        assert env["GENQ_METRICS_HOST"] == "0.0.0.0"
        assert {sd["port"] for sd in worker_sd} == {port}
        assert f"127.0.0.1:{port}/metrics" in " ".join(argv(services[name]["healthcheck"]["test"]))
    for sd in api_sd + worker_sd:
        assert set(sd["names"]) <= set(PROFILES["vllm"] | DEFAULT_SERVICES), sd


def test_vllm_worker_runs_the_worker_from_its_own_image(services, stack_commands):
    _, worker_command = stack_commands
    svc = services["vllm-worker"]
    got = argv(svc["command"])
    assert same_program(got[0], worker_command[0]) and got[1:] == list(worker_command[1:])
    env = env_of(svc)
    assert env["GENQ_ENGINE"] == "vllm"
    assert env["GENQ_MODEL_NAME"] and env["GENQ_MODEL_NAME"] != env_of(services["worker"]).get("GENQ_MODEL_NAME")
    assert env["REDIS_URL"] == env_of(services["api"])["REDIS_URL"]
    build = svc["build"]
    assert (REPO_ROOT / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE_VLLM
    assert build["args"]["VLLM_REQUIREMENTS"] == "requirements-vllm-cpu.txt", "CPU build by default"
    assert svc["image"] != services["worker"]["image"]
    deps = depends_on(svc)
    assert deps["redis"]["condition"] == "service_healthy"
    assert deps["model-init"]["condition"] == "service_completed_successfully"
    assert volume_mounts(svc)["/models"] == ("models", True)


def docs_text() -> str:
    """The README and the page that owns deploying."""
    return (REPO_ROOT / "README.md").read_text() + (REPO_ROOT / "docs" / "deploying.md").read_text()


def test_gpu_override_reserves_gpus_and_switches_to_the_cuda_build(services):
    override = yaml.safe_load(GPU_OVERRIDE.read_text())["services"]
    assert set(override) == {"vllm-worker"}
    svc = override["vllm-worker"]
    assert svc["build"]["args"]["VLLM_REQUIREMENTS"] == "requirements-vllm.txt"
    (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    for name in ("requirements-vllm.txt", "requirements-vllm-cpu.txt"):
        assert (REPO_ROOT / name).is_file()
    assert "docker-compose.gpu.yml" in docs_text()


def test_dockerfile_vllm():
    text = re.sub(r"\\\n", " ", DOCKERFILE_VLLM.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert [line for line in lines if line.startswith("FROM ")][-1].split()[1].startswith(TESTED_PYTHON)
    runs = " ".join(line for line in lines if line.startswith("RUN "))
    assert '-r "$VLLM_REQUIREMENTS"' in runs and "uninstall" in runs and "torchvision" in runs
    user = [line for line in lines if line.startswith("USER ")][-1].split()[1]
    assert user not in {"root", "0"}
    assert json.loads([line for line in lines if line.startswith("CMD ")][-1][4:]) == ["python", "-m", "worker"]
    for requirements in ("requirements-vllm.txt", "requirements-vllm-cpu.txt"):
        assert "prometheus-client==" in (REPO_ROOT / requirements).read_text(), "worker/metrics.py needs it"


def test_monitoring_mounts_files_that_exist(services):
    for name in PROFILES["monitoring"]:
        for target, (source, read_only) in volume_mounts(services[name]).items():
            if source and source.startswith("./"):
                assert (REPO_ROOT / source).exists(), (name, source)
                assert read_only, (name, target)
    assert "/etc/prometheus/prometheus.yml" in volume_mounts(services["prometheus"])


def _exposed(registry) -> set[str]:
    """Sample names a scrape of this registry shows."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    return {f.name + s for f in registry.collect() for s in suffixes[f.type]}


def metric_names() -> set[str]:
    """Every sample name the API's and a worker's /metrics show (tests/test_metrics.py checks
    them live)."""
    from prometheus_client import CollectorRegistry

    from webapp import metrics as api
    from worker.metrics import WorkerMetrics

    registry = CollectorRegistry()
    WorkerMetrics("m", "hf", 2048, registry=registry)
    api.ApiMetrics(registry=registry)
    names = _exposed(registry)
    return names | {api.WORKERS_LIVE[0], api.WAITING[0]}


def test_grafana_dashboard_queries_metrics_that_exist():
    names = metric_names()
    datasources = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (ds,) = datasources["datasources"]
    assert ds["url"] == "http://prometheus:9090" and ds["type"] == "prometheus"
    providers = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/genqueue.yml").read_text())
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"

    dashboard = json.loads((MONITORING / "grafana/dashboards/genqueue.json").read_text())
    titles = " | ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("time to first token", "queue time", "tokens/s", "batch size", "queue depth", "live workers"):
        assert topic in titles, topic
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"]]
    used = {m for e in exprs for m in re.findall(r"genq:[a-z0-9_]+", e)}
    assert used and used <= names, used - names
    ttft = next(p for p in dashboard["panels"] if "first token" in p["title"].lower())
    assert {"p50", "p90"} <= {t["legendFormat"] for t in ttft["targets"]}
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == ds["uid"]


def test_locust_runs_from_our_image_against_the_api(services):
    """The locust profile runs the project's image (locust at requirements-dev.txt's pin,
    installed by the Dockerfile; locustfile.py copied in), no image of Docker Hub."""
    master, worker = services["locust"], services["locust-worker"]
    cmd = argv(master["command"])
    assert cmd[0] == "locust" and "--master" in cmd and cmd[cmd.index("--host") + 1] == f"http://api:{API_PORT}"
    assert [(pub, target) for _, pub, target in published_ports(master)] == [("8089", 8089)]
    wcmd = argv(worker["command"])
    assert wcmd[0] == "locust" and "--worker" in wcmd and wcmd[wcmd.index("--master-host") + 1] == "locust"
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip()[:1] not in ("", "#")]
    for svc in (master, worker):
        assert svc["image"] == services["api"]["image"] and not svc.get("build")
        c = argv(svc["command"])
        assert c[c.index("-f") + 1] == "locustfile.py"  # WORKDIR /app: the image's copy
        assert not dockerignored("locustfile.py", patterns)
        assert "GENQ_API_KEY" in env_of(svc), "a stack with keys needs one for the users"
    assert depends_on(master)["api"]["condition"] == "service_healthy"
    pin = re.search(r"^locust==\S+$", (REPO_ROOT / "requirements-dev.txt").read_text(), re.M)
    assert pin, "requirements-dev.txt pins locust"
    runs = " ".join(rest for op, rest in _dockerfile_instructions() if op == "RUN")
    assert "locust" in runs and "requirements-dev.txt" in runs


def test_flower_needs_basic_auth_and_runs_celery_flower(services, tmp_path):
    svc = services["flower"]
    assert svc["image"] == services["api"]["image"], "Flower runs from the app image (tasks.flower_app)"
    assert [(pub, target) for _, pub, target in published_ports(svc)] == [("5555", 5555)]
    assert "FLOWER_BASIC_AUTH" in env_of(svc)
    cmd = interpolate(argv(svc["command"]))
    script = cmd[cmd.index("-c") + 1]
    stub = tmp_path / "celery"
    stub.write_text('#!/bin/sh\necho "CELERY $*"\n')
    stub.chmod(0o755)

    def run(auth: str | None) -> subprocess.CompletedProcess:
        env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"}
        if auth is not None:
            env["FLOWER_BASIC_AUTH"] = auth
        return subprocess.run([shutil.which("sh"), "-c", script], env=env, capture_output=True, text=True, timeout=30)

    for missing in (None, ""):
        refused = run(missing)
        assert refused.returncode != 0 and "CELERY" not in refused.stdout
    ok = run("admin:secret")
    assert ok.returncode == 0
    assert "CELERY -A tasks.flower_app flower" in ok.stdout and "--port=5555" in ok.stdout
    assert "GENQ_CELERY_EVENTS" in env_of(svc), "the workers' events switch is in the shared environment"


# --------------------------------------------------------------------------- building behind a mirror

PIP_ARGS = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST")
BUILDS = {"api": DOCKERFILE, "vllm-worker": DOCKERFILE_VLLM}


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split()[0].upper(), line.partition(" ")[2].strip()) for line in lines]


def test_dockerfiles_need_no_frontend_image():
    """A `# syntax=` line makes BuildKit pull docker/dockerfile from Docker Hub: the frontend
    built into the engine reads everything here (RUN --mount included)."""
    for path in BUILDS.values():
        first = path.read_text().lstrip().splitlines()[0]
        assert not re.match(r"#\s*syntax\s*=", first, re.I), f"{path.name}: {first}"
        assert not any(re.match(r"#\s*(syntax|escape|check)\s*=", line, re.I) for line in path.read_text().splitlines())


def test_pip_settings_are_build_arguments_and_the_ca_bundle_a_secret():
    """Every pip run sees the index settings (ARGs are in its environment, not the image's)
    and, when the build has the `ca_bundle` secret with something in it, trusts that bundle."""
    for path in BUILDS.values():
        instr = _instructions(path)
        declared = {rest.partition("=")[0] for op, rest in instr if op == "ARG"}
        assert {*PIP_ARGS, "TORCH_INDEX"} <= declared, path.name
        assert not [rest for op, rest in instr if op == "ENV" and "PIP_INDEX_URL" in rest], "an index stays out of ENV"
        first_arg = next(i for i, (op, rest) in enumerate(instr) if op == "ARG" and rest.startswith("PIP_"))
        pip_runs = [(i, rest) for i, (op, rest) in enumerate(instr) if op == "RUN" and "pip install" in rest]
        assert pip_runs, path.name
        for i, rest in pip_runs:
            assert i > first_arg, f"{path.name}: a pip run before the pip ARGs"
            assert rest.startswith("--mount=type=secret,id=ca_bundle "), (path.name, rest[:80])
            assert "if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi" in rest
    apt = [rest for op, rest in _instructions(DOCKERFILE_VLLM) if op == "RUN" and "apt-get" in rest]
    assert apt and all(rest.startswith("--mount=type=secret,id=ca_bundle ") for rest in apt)


def test_compose_passes_the_pip_settings_from_env_with_defaults(compose, services):
    """Both builds take the pip settings from the shell or .env; unset, pip's defaults and
    PyTorch's CPU index; TORCH_INDEX set empty stays empty (torch from pip's own index)."""
    for name, dockerfile in BUILDS.items():
        build = services[name]["build"]
        assert (REPO_ROOT / build["context"] / build["dockerfile"]).resolve() == dockerfile
        args = build["args"]
        declared = {rest.partition("=")[0] for op, rest in _instructions(dockerfile) if op == "ARG"}
        assert set(args) <= declared, f"{name}: build args its Dockerfile does not declare: {set(args) - declared}"
        unset = interpolate(args)
        assert unset["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
        assert all(unset[k] == "" for k in PIP_ARGS), unset
        mirror = {
            "PIP_INDEX_URL": "https://mirror.example/pypi/simple",
            "PIP_EXTRA_INDEX_URL": "https://mirror.example/extra/simple",
            "PIP_FIND_LINKS": "https://mirror.example/wheels/",
            "PIP_TRUSTED_HOST": "mirror.example",
            "TORCH_INDEX": "",
        }
        assert {k: v for k, v in interpolate(args, mirror).items() if k in mirror} == mirror
        assert [s if isinstance(s, str) else s["source"] for s in build["secrets"]] == ["ca_bundle"]
    secret = compose["secrets"]["ca_bundle"]["file"]
    placeholder = REPO_ROOT / interpolate(secret)
    assert placeholder.is_file() and placeholder.stat().st_size == 0, "no bundle: an empty file the builds skip"
    assert interpolate(secret, {"PIP_CERT": "/etc/ssl/certs/corp.pem"}) == "/etc/ssl/certs/corp.pem"


def test_gpu_build_keeps_the_pip_settings():
    """docker-compose.gpu.yml changes the requirements and the torch index, nothing else of the
    build: compose merges its args over the base file's, so the mirror settings stay."""
    override = yaml.safe_load(GPU_OVERRIDE.read_text())["services"]["vllm-worker"]["build"]
    assert set(override) == {"args"} and set(override["args"]) == {"VLLM_REQUIREMENTS", "TORCH_INDEX"}


def test_vllm_image_has_what_the_vllm_wheel_links():
    """vllm._C* (the CPU build's kernels) link libnuma.so.1, which the slim image lacks; the build
    loads them as vLLM does and asks for an op, so a missing library fails the build rather than
    crash-looping the worker. Not `import vllm._C` by name: that build is AVX-512's, and dies of
    SIGILL on an AVX2-only CPU, where vLLM loads _C_AVX2."""
    runs = " ".join(rest for op, rest in _instructions(DOCKERFILE_VLLM) if op == "RUN")
    assert re.search(r"apt-get \S* ?install -y --no-install-recommends [^;]*\blibnuma1\b", runs), runs
    assert "import_kernels()" in runs and "torch.ops._C." in runs
    assert "vllm._C'" not in runs and "import vllm._C" not in runs


def test_served_model_names_are_the_readmes(services):
    """Compose serves the default model as `smollm2-135m-instruct` (as `make run` does) and its
    vLLM worker's as `smollm2-135m-instruct-vllm`,
    as the README and docs/deploying.md name them; a model set in .env serves under
    its own name unless GENQ_MODEL_NAME says otherwise, and the vLLM worker's is `<name>-vllm`."""
    from scripts import compose_check

    docs = docs_text()
    assert '"model": "smollm2-135m-instruct"' in docs and 'model "smollm2-135m-instruct-vllm"' in docs
    cases = [
        ({}, "smollm2-135m-instruct", "smollm2-135m-instruct-vllm"),
        ({"GENQ_MODEL": "facebook/opt-125m"}, "facebook/opt-125m", "facebook/opt-125m-vllm"),
        ({"GENQ_MODEL": "facebook/opt-125m", "GENQ_MODEL_NAME": "opt"}, "opt", "opt-vllm"),
        ({"GENQ_VLLM_MODEL_NAME": "fast"}, "smollm2-135m-instruct", "fast"),
    ]
    for env, hf, vllm in cases:
        for name in ("api", "worker"):
            assert interpolate(services[name]["environment"]["GENQ_MODEL_NAME"], env) == hf, (name, env)
        assert interpolate(services["vllm-worker"]["environment"]["GENQ_MODEL_NAME"], env) == vllm, env
    assert (compose_check.HF_MODEL, compose_check.VLLM_MODEL) == ("smollm2-135m-instruct", "smollm2-135m-instruct-vllm")


# --------------------------------------------------------------------------- make test-compose


def test_make_test_compose_runs_the_check_and_make_test_does_not():
    makefile = (REPO_ROOT / "Makefile").read_text()
    recipe = re.search(r"^test-compose:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe and "scripts.compose_check" in recipe.group(1)
    for target in ("test", "test-core"):
        rule = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", makefile, re.M)
        assert rule and "compose_check" not in rule.group(0), target
    assert "make test-compose" in docs_text()


def test_compose_check_serves_local_wheels_to_the_build(tmp_path):
    """A find-links folder or file:// index on this host becomes a URL on the check's HTTP
    server (a build sees no host path); remote locations stay; missing folders are left out.
    The server answers with the folder's files."""
    from scripts import compose_check

    wheels, index = tmp_path / "wheels", tmp_path / "pypi" / "simple"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"wheel")
    (index / "six").mkdir(parents=True)
    (index / "six" / "index.html").write_text("<a href='../../six.whl'>six</a>")
    settings = {
        "PIP_FIND_LINKS": f"{wheels} https://mirror.example/wheels/ {tmp_path / 'gone'}",
        "PIP_EXTRA_INDEX_URL": f"file://{index}",
        "PIP_TRUSTED_HOST": "mirror.example",
    }
    out, served = compose_check.serve_local(settings, 12345)
    assert out["PIP_FIND_LINKS"] == "http://127.0.0.1:12345/0/ https://mirror.example/wheels/"
    assert out["PIP_EXTRA_INDEX_URL"] == "http://127.0.0.1:12345/1/simple/"
    assert out["PIP_TRUSTED_HOST"] == "mirror.example" and "PIP_INDEX_URL" not in out
    assert served == {"0": wheels, "1": index.parent}
    server, port = compose_check.start_wheel_server(served)
    try:
        import urllib.request

        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/0/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl") as r:
            assert r.read() == b"wheel"
        with urllib.request.urlopen(f"{base}/1/simple/six/") as r:
            assert b"six.whl" in r.read()
    finally:
        server.shutdown()
        server.server_close()
