# syntax=docker/dockerfile:1
# The course on NVIDIA GPU nodes: the CUDA build of the pinned torch, the pinned environment, course_lib, a non-root
# user, and `make gpu-check` as the smoke test.
#   docker build -t distributed-llm-course:gpu .
#   docker run --rm --gpus all distributed-llm-course:gpu                  # make gpu-check: node, notebooks, MFU
#   docker run --rm --gpus all distributed-llm-course:gpu nvidia-smi       # the host's driver, from inside

# "devel", not "base" or "runtime": DeepSpeed compiles its fused and CPU Adam kernels (ZeRO-Offload) the first
# time they are used, which needs nvcc and the CUDA headers of this image, and a C++ compiler (below). The torch
# wheel brings its own CUDA runtime, cuBLAS, cuDNN and NCCL. No driver here: the host provides it at run time.
FROM nvidia/cuda:12.8.1-devel-ubuntu24.04

# The CUDA variant of the wheel must not be newer than what the cluster's drivers support.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# python3-dev, g++ and ninja for the kernels DeepSpeed builds at first use; make for `make gpu-check`.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ make ca-certificates \
 && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first, from the CUDA wheel index: requirements.txt pins the same version (2.13.0 matches 2.13.0+cu128),
# so pip keeps this build instead of fetching the CPU one.
RUN pip install "torch==${TORCH_VERSION}" ninja --index-url "${TORCH_INDEX_URL}" --extra-index-url https://pypi.org/simple

# The pinned environment in its own layer: it changes rarely, the code often, and layers are cached.
COPY requirements.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt

# An unprivileged user; UID 1000 is the first user on most hosts, so files written to mounted folders
# belong to you, not to root. (Ubuntu 24.04 images already have a user 'ubuntu' with that UID.)
RUN (userdel --remove ubuntu 2>/dev/null || true) \
 && useradd --create-home --uid 1000 --shell /bin/bash course \
 && install -d -o course -g course /home/course/course
WORKDIR /home/course/course
COPY --chown=course:course . .
# The Makefile's environment is /opt/venv here: the stamp tells make that it is installed already.
RUN pip install --no-deps -e . && touch /opt/venv/.installed
USER course

# Defaults for every job; a cluster's job script adds its network settings (see the NCCL chapter).
ENV NCCL_DEBUG=WARN \
    OMP_NUM_THREADS=1

CMD ["make", "gpu-check", "VENV=/opt/venv"]
