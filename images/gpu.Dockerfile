# syntax=docker/dockerfile:1.7
# AR and DiT steps (one image: they share the model code and weights) and nothing else.
# CUDA runtime base + pinned torch + the pinned runtime closure + Mooncake with its RDMA libraries.
# Build context: the repository root (images/build.sh; see images/README.md).
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.13.0
# The CUDA build of torch to match the base image's CUDA major version.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/tmp/hf

# libibverbs1 + ibverbs-providers + rdma-core: Mooncake's transfer engine links libibverbs even for
# TCP, and needs the providers for RDMA NICs. libnuma1: Mooncake's memory pinning.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates libibverbs1 ibverbs-providers rdma-core libnuma1 \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# torch first, from its own index, so nothing later can swap it for another build.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY images/requirements-gpu.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt

# The project itself last (changes most often); --no-deps: everything is pinned above.
COPY pyproject.toml README.m[d] /src/
COPY components /src/components
COPY pipeline /src/pipeline
RUN pip install --no-deps /src && rm -rf /src

RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin ardit
USER 10001
WORKDIR /home/ardit
# Smoke check at build time: the step programs and Mooncake import.
RUN python -c "import components, torch, mooncake.store; print('torch', torch.__version__)"
