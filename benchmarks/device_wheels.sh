#!/usr/bin/env bash
# Wheels a served run (dsv4 up, benchmarks/bench_e2e*.py) needs on the device image and does not
# find there: its grpcio is 1.84 while the generated stubs (protos/) need >= 1.85.1, and it has no
# grpcio-health-checking, grpcio-reflection or redis (2026-12-07). CPython 3.12, x86-64.
#
#   bash benchmarks/device_wheels.sh [OUT_DIR]        (default artifacts/wheels, git-ignored)
# then carry OUT_DIR (with .whl/nixl*.whl for a disaggregated run) and, on the host:
#   pip install -q --no-index --no-deps --target /tmp/site OUT_DIR/*.whl && export PYTHONPATH=$PWD:/tmp/site
set -euo pipefail
out=${1:-artifacts/wheels}
mkdir -p "$out"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$out" "grpcio==1.85.4" "grpcio-health-checking==1.85.1" "grpcio-reflection==1.85.1" \
    "redis>=5.0" 2> >(grep -v 'is ignored' >&2)
ls "$out"
