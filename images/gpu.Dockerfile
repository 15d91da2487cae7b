# syntax=docker/dockerfile:1.7
# AR, DiT and accuracy-sweep steps (one image: they share the model code and weights).
# Python base + CUDA torch (its wheels bring the CUDA user-space libraries; the driver comes from
# the node through the NVIDIA container runtime) + the pinned closure of what those steps import
# (pipeline.images) + the CUDA build of Mooncake with its RDMA libraries.
# Build context: the repository root (images/build.sh; see images/README.md).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH_VERSION=2.13.0
# The CUDA build of torch; its nvidia-* wheels carry CUDA 13 (the node's driver must support it).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/tmp/hf \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# libibverbs1 + ibverbs-providers (libmlx5) + rdma-core: Mooncake's transfer engine links
# libibverbs even for TCP and needs the providers for RDMA NICs. libnuma1: memory pinning.
# libcurl4: Mooncake's store links it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        ca-certificates libibverbs1 ibverbs-providers rdma-core libnuma1 libcurl4 \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv

# torch first, from its own index, so nothing later can swap it for another build.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY images/requirements-gpu.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt
# mooncake-transfer-engine (CUDA build) loads libcudart.so.12 from the nvidia-cuda-runtime-cu12
# wheel: put that directory on the loader path.
RUN python -c "import importlib.util as u; print(u.find_spec('nvidia.cuda_runtime').submodule_search_locations[0] + '/lib')" \
        > /etc/ld.so.conf.d/ardit-cudart12.conf \
    && ldconfig

# The project itself last (changes most often); --no-deps: everything is pinned above.
COPY pyproject.toml README.m[d] /src/
COPY components /src/components
COPY pipeline /src/pipeline
RUN pip install --no-deps /src && rm -rf /src

RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin ardit
USER 10001
WORKDIR /home/ardit
# Build-time proof that this image runs its steps: every step module imports and answers --help,
# every third-party module they can reach imports (Mooncake's CUDA build only up to the GPU
# driver's libcuda, which the node provides at run time: checked with ldd instead).
RUN python -m pipeline.images check gpu
