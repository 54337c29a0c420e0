# syntax=docker/dockerfile:1
# The course on NVIDIA GPU nodes: the CUDA build of the pinned torch, the pinned environment with DeepSpeed,
# course_lib, InfiniBand user libraries for NCCL, a non-root user, and `make gpu-check` as the smoke test.
# Two images from one file:
#   learner     (the default: the last stage) the repository without solutions/, the image a learner runs
#   instructor  the same environment and repository with solutions/ (answers and hidden tests) added
#
#   docker build --platform linux/amd64 --target learner -t distributed-llm-course:gpu .
#   docker build --platform linux/amd64 --target instructor -t distributed-llm-course:instructor .
#   docker run --rm --gpus all --ipc=host --shm-size=16g distributed-llm-course:gpu              # make gpu-check
#   docker run --rm --gpus all distributed-llm-course:gpu nvidia-smi      # the host's driver, from inside
# --ipc=host --shm-size=16g: PyTorch's DataLoader workers and NCCL use /dev/shm, and Docker's default is 64 MB.
# --platform linux/amd64: cluster nodes are x86_64; on an arm64 Mac the same line builds the x86_64 image through
# emulation (slower, but it works). book/gpu/docker.md explains every line; course.def turns the image into an
# Apptainer image for clusters.

# "devel", not "base" or "runtime": DeepSpeed compiles its fused and CPU Adam kernels (ZeRO-Offload) the first
# time they are used, which needs nvcc and the CUDA headers of this image, and a C++ compiler (below). The torch
# wheel brings its own CUDA runtime, cuBLAS, cuDNN and NCCL. No driver here: the host provides it at run time.
FROM nvidia/cuda:12.8.1-devel-ubuntu24.04 AS environment

# The CUDA variant of the wheel must not be newer than what the cluster's drivers support.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# python3-dev, g++ and ninja for the kernels DeepSpeed builds at first use; libaio-dev for its NVMe offload
# (config/deepspeed_zero3_offload_nvme.json); make for `make gpu-check`. The InfiniBand user space: libibverbs1
# with ibverbs-providers (the drivers of the cards, mlx5 among them), librdmacm1t64 (librdmacm1 before Ubuntu
# 24.04) and rdma-core; without them NCCL finds no InfiniBand device in the container and falls back to TCP
# sockets. ibverbs-utils adds ibv_devinfo, which lists the cards the container sees.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ make ca-certificates \
        libaio-dev libibverbs1 ibverbs-providers librdmacm1t64 rdma-core ibverbs-utils \
 && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first, from the CUDA wheel index: requirements.txt pins the same version (2.13.0 matches 2.13.0+cu128),
# so pip keeps this build instead of fetching the CPU one.
RUN pip install "torch==${TORCH_VERSION}" ninja --index-url "${TORCH_INDEX_URL}" --extra-index-url https://pypi.org/simple

# The pinned environment in its own layer: it changes rarely, the code often, and layers are cached. DeepSpeed,
# optional on a laptop, belongs to the GPU image.
COPY requirements.txt requirements-deepspeed.txt /tmp/
RUN pip install -r /tmp/requirements.txt \
 && pip install -r /tmp/requirements-deepspeed.txt -c /tmp/requirements.txt

# An unprivileged user; UID 1000 is the first user on most hosts, so files written to mounted folders
# belong to you, not to root. (Ubuntu 24.04 images already have a user 'ubuntu' with that UID.)
# runs/, logs/ and data/ are empty mount points: the course writes there, relative to the repository root, and
# a container mounts host folders onto them (Apptainer runs the image read-only).
RUN (userdel --remove ubuntu 2>/dev/null || true) \
 && useradd --create-home --uid 1000 --shell /bin/bash course \
 && install -d -o course -g course /home/course/course \
        /home/course/course/runs /home/course/course/logs /home/course/course/data
WORKDIR /home/course/course

# Defaults for every job; a cluster's job script adds its network settings (see the NCCL chapter).
ENV NCCL_DEBUG=WARN \
    OMP_NUM_THREADS=1

CMD ["make", "gpu-check", "VENV=/opt/venv"]

# The repository, folder by folder: solutions/ is not among them, so no layer of the learner image holds it, nor
# the grading suite's answers (COPY --exclude: Dockerfile syntax 1.19 or newer, which the first line selects).
# (.dockerignore cannot do this: it applies to every target alike.)
FROM environment AS repository
COPY --chown=course:course Makefile pyproject.toml requirements.txt requirements-deepspeed.txt environment.yml \
     README.md _config.yml _toc.yml nbgrader_config.py ./
COPY --chown=course:course course_lib course_lib/
COPY --chown=course:course course_tools course_tools/
COPY --chown=course:course config config/
COPY --chown=course:course scripts scripts/
COPY --chown=course:course notebooks notebooks/
COPY --chown=course:course book book/
# tests/course/test_grading.py holds the grading suite's wrong and right answers to every exercise: instructors only
COPY --chown=course:course --exclude=course/test_grading.py tests tests/
# The Makefile's environment is /opt/venv here: the stamp tells make that it is installed already. The bytecode
# is compiled now, since Apptainer runs the image read-only and Python could not write it there.
RUN pip install --no-deps -e . \
 && python -m compileall -q course_lib course_tools scripts \
 && touch /opt/venv/.installed
USER course

FROM repository AS instructor
COPY --chown=course:course solutions solutions/
COPY --chown=course:course tests/course/test_grading.py tests/course/

# Last, so that a build without --target gives it.
FROM repository AS learner
