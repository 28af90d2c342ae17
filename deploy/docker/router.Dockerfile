# syntax=docker/dockerfile:1
# dsv4 router image: the public gRPC front. No torch, no CUDA, no NIXL: only the packages the
# router imports (tests/deploy/test_dockerfiles.py checks this list against its real imports).
# Build from the repository root:
#   docker build -f deploy/docker/router.Dockerfile -t registry.example.com/dsv4-serve/router:0.1.0 .
FROM python:3.12.8-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/*

RUN pip install \
      "grpcio>=1.66" "grpcio-health-checking>=1.66" "grpcio-reflection>=1.66" \
      "protobuf>=5.28" "redis>=5.0" "tokenizers>=0.20" "numpy>=1.26" \
      "prometheus-client>=0.20" "pyyaml>=6.0"

# --no-deps: the distribution's own dependencies include torch and nixl, which the router
# never imports.
WORKDIR /opt/dsv4/src
COPY pyproject.toml README.md ./
COPY dsv4 ./dsv4
COPY kernels ./kernels
COPY prefill_svc ./prefill_svc
COPY decode_svc ./decode_svc
COPY router_svc ./router_svc
COPY loadgen ./loadgen
COPY benchmarks ./benchmarks
RUN pip install --no-deps . \
 && python -c "import router_svc.server, loadgen.cli"

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
