# syntax=docker/dockerfile:1
# dsv4 worker image (prefill and decode): CUDA, torch, Triton, FlashInfer, NIXL (UCX), dsv4.
# NIXL comes as nixl-cu13 alone (the worker extra), matching this CUDA 13 base.
# Build from the repository root:
#   docker build -f deploy/docker/worker.Dockerfile -t registry.example.com/dsv4-serve/worker:0.1.0 .
# The devel base is deliberate: Triton compiles a launcher stub with gcc and FlashInfer JIT-builds
# kernels with nvcc at run time (the first sampling op builds for ~100 s;
# docs/architecture.md#platform-notes).
FROM nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04

ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130

# rdma-core user space (libibverbs, librdmacm, mlx5 provider) for UCX's RC transport;
# python3-dev + gcc for Triton's launcher; tini reaps children and forwards SIGTERM.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3.12 python3.12-venv python3.12-dev gcc g++ \
      rdma-core ibverbs-providers libibverbs1 librdmacm1 ibverbs-utils \
      numactl tini ca-certificates \
 && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3.12 -m venv /opt/venv \
 && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# Dependencies first (a code change does not re-download them), then the code.
WORKDIR /opt/dsv4/src
COPY pyproject.toml README.md ./
COPY dsv4 ./dsv4
COPY kernels ./kernels
COPY prefill_svc ./prefill_svc
COPY decode_svc ./decode_svc
COPY router_svc ./router_svc
COPY loadgen ./loadgen
COPY benchmarks ./benchmarks
# The checks run outside the source tree (from it, `import` finds the copied sources).
RUN pip install ".[worker,gpu]" \
 && cd / && dsv4 --version \
 && python -c "import dsv4, prefill_svc, decode_svc, nixl_cu13, triton, torch"
COPY deploy/scripts/drain.py /opt/dsv4/drain.py

# Non-root by default (uid 10001). The prod-multi-node overlay runs workers as root with only
# CAP_IPC_LOCK, which RDMA memory registration needs (docs/operations.md).
RUN groupadd --gid 10001 dsv4 \
 && useradd --uid 10001 --gid 10001 --home-dir /cache --no-create-home --shell /usr/sbin/nologin dsv4 \
 && mkdir -p /cache && chown dsv4:dsv4 /cache
ENV HOME=/cache
USER 10001:10001
WORKDIR /cache

# 50061: worker gRPC (worker.port in the cluster configs); 9400: Prometheus (metrics.prometheus_port).
EXPOSE 50061 9400
# Kubernetes uses native gRPC probes (deploy/k8s/base); this is for plain `docker run`.
HEALTHCHECK --interval=15s --timeout=5s --start-period=1200s --retries=3 \
  CMD ["python", "-c", "import grpc,sys;from grpc_health.v1 import health_pb2 as h,health_pb2_grpc as g;c=grpc.insecure_channel('127.0.0.1:50061');sys.exit(g.HealthStub(c).Check(h.HealthCheckRequest(),timeout=4).status!=1)"]

ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["dsv4", "--help"]
