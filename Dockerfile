# syntax=docker/dockerfile:1.7
# One image, two entrypoints, multi-arch (linux/amd64, and linux/arm64 for GH200):
#   engine    superinfer serve --model ... --host 0.0.0.0 --port 8000   (the default command)
#   operator  python -m superinfer.operator
#
#   docker buildx build --platform linux/amd64,linux/arm64 -t ghcr.io/superinfer/superinfer:0.1.0 --push .
#
# TORCH_INDEX_URL picks the PyTorch wheels: the default CUDA 12.8 index has x86_64 and aarch64
# (GH200) builds; for a small CPU-only image (kind, e2e, laptops) use the CPU index:
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PYTHON_VERSION=3.12

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_SPEC="torch>=2.5"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/superinfer
ENV PATH=/opt/superinfer/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli cli
COPY engine engine
COPY kernels kernels
COPY operator operator
COPY workload workload
COPY sim sim
COPY bench bench
# cuda-bindings gives the engine the `batch` KV copy method (cudaMemcpyBatchAsync, CUDA >= 12.8);
# match its major version to the torch wheels' CUDA. The startup probe leaves the method out
# wherever it cannot run (a CPU image, an older driver).
ARG CUDA_BINDINGS_SPEC="cuda-bindings>=12.8,<13"
RUN pip install ".[operator]" "${CUDA_BINDINGS_SPEC}" \
 && python -c "import superinfer.cli.main, superinfer.operator.main"

FROM python:${PYTHON_VERSION}-slim
# Triton compiles small launcher stubs at run time and needs a C compiler for that.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 1000 superinfer \
 && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin superinfer
COPY --from=build /opt/superinfer /opt/superinfer
ENV PATH=/opt/superinfer/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    HF_HOME=/models/.hf
WORKDIR /tmp
USER 1000:1000
EXPOSE 8000
CMD ["superinfer", "serve", "--model", "tiny", "--device", "cpu", "--host", "0.0.0.0", "--port", "8000"]
