# syntax=docker/dockerfile:1
# dsv4 router image: the public gRPC front. No torch, no CUDA, no NIXL: `.[router]` is the
# package's torch-free base set (tests/unit/test_packaging.py checks it covers the router's imports).
# Build from the repository root:
#   docker build -f deploy/docker/router.Dockerfile -t registry.example.com/dsv4-serve/router:0.1.0 .
FROM python:3.12.8-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/dsv4/src
COPY pyproject.toml README.md ./
COPY dsv4 ./dsv4
COPY kernels ./kernels
COPY prefill_svc ./prefill_svc
COPY decode_svc ./decode_svc
COPY router_svc ./router_svc
COPY loadgen ./loadgen
COPY benchmarks ./benchmarks
# The checks run outside the source tree: from it, `import` would find the copied sources, not
# what the wheel installed.
RUN pip install ".[router]" \
 && cd / && dsv4 --version \
 && python -c "import sys, router_svc.server, loadgen.cli; assert 'torch' not in sys.modules"

RUN groupadd --gid 10001 dsv4 \
 && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin dsv4
USER 10001:10001
WORKDIR /tmp

# 50051: router gRPC (router.port); 9400: Prometheus (metrics.prometheus_port).
EXPOSE 50051 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import grpc,sys;from grpc_health.v1 import health_pb2 as h,health_pb2_grpc as g;c=grpc.insecure_channel('127.0.0.1:50051');sys.exit(g.HealthStub(c).Check(h.HealthCheckRequest(),timeout=4).status!=1)"]

ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["dsv4", "router"]
