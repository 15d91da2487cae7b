# syntax=docker/dockerfile:1.7
# CPU steps (shard, summary), the step launcher, and the Mooncake servers (master, HTTP metadata
# server, segment holders with their readiness probe: manifests/base/mooncake.yaml). No CUDA.
# Build context: the repository root (images/build.sh; see images/README.md).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/tmp/hf

# Mooncake's binaries and Python module need libibverbs (even over TCP), libnuma and libcurl.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers rdma-core libnuma1 libcurl4 \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv

# CPU torch: the shard step validates prompts with the model's tokenizer code, which imports it.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY images/requirements-tools.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt

COPY pyproject.toml README.m[d] /src/
COPY components /src/components
COPY pipeline /src/pipeline
RUN pip install --no-deps /src && rm -rf /src

RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin ardit
USER 10001
WORKDIR /home/ardit
# Build-time proof: steps import and answer --help, everything they can import imports, the
# Mooncake server binaries are on PATH.
RUN python -m pipeline.images check tools
