# syntax=docker/dockerfile:1
#
# One image for every genqueue process; docker-compose.yml picks the command:
#   api:        gunicorn --config python:webapp.gunicorn_conf "webapp:create_app()"   (the default CMD)
#   worker:     python -m worker
#   model-init: python -m scripts.devmodels --shape tiny --out /models/tiny-opt
#
# No model is downloaded at build time: the tiny offline model is built into the
# `models` volume by the model-init service, and a hub model (GENQ_MODEL=facebook/opt-125m)
# is fetched by the worker at start-up into HF_HOME (mount a volume there to keep it).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    HF_HOME=/home/app/.cache/huggingface \
    GENQ_HOST=0.0.0.0 \
    GENQ_PORT=8000

# Unprivileged runtime user. /models and HF_HOME are created (and owned by it) in the
# image so that named volumes mounted there start out writable by that user.
RUN groupadd --system --gid 10001 app \
 && useradd --system --uid 10001 --gid app --create-home --home-dir /home/app app \
 && mkdir -p /models "$HF_HOME" \
 && chown -R app:app /models /home/app

WORKDIR /app

# Dependencies first, so code changes don't invalidate this layer.
# requirements.txt pins torch, whose PyPI wheel is the CUDA build: install the pinned
# torch from the PyTorch CPU wheel index first (the "+cpu" local version satisfies
# torch==X.Y.Z), then everything else, minus CUDA-only runtime packages.
COPY requirements.txt ./
RUN set -eux; \
    torch_req="$(grep -iE '^[[:space:]]*torch[[:space:]]*(==|>=|~=|<|$)' requirements.txt | head -n1 | sed -e 's/[[:space:]]*[#;].*$//' -e 's/[[:space:]]//g')"; \
    pip install --index-url https://download.pytorch.org/whl/cpu "${torch_req:-torch}"; \
    grep -viE '^[[:space:]]*(nvidia-|triton([[:space:]=<>~!;]|$)|xgrammar)' requirements.txt > /tmp/requirements-cpu.txt; \
    pip install -r /tmp/requirements-cpu.txt; \
    pip install --no-deps "$(grep -iE '^[[:space:]]*xgrammar[[:space:]]*==' requirements.txt | sed -e 's/[[:space:]]//g')"; \
    rm -f /tmp/requirements-cpu.txt; \
    python -c "import torch; assert not torch.version.cuda, torch.version.cuda; print('torch', torch.__version__)"

COPY . .

USER app

EXPOSE 8000

CMD ["gunicorn", "--config", "python:webapp.gunicorn_conf", "webapp:create_app()"]
