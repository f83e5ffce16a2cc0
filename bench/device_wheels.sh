#!/usr/bin/env bash
# The server's packages the device image lacks, as wheels for its Python (3.12, x86-64) in .whl/, for
# `bash bench/device_check.sh OUT api` (the device call carries `.whl`; pip cannot reach an index there).
#   bash bench/device_wheels.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
# resolved together, so the versions agree (pydantic pins pydantic-core); the image's own torch, numpy, safetensors,
# tokenizers, jinja2, httpx, prometheus-client and xxhash serve as they are
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any -d .whl \
  fastapi uvicorn httptools redis crc32c grpcio-tools grpcio-health-checking grpcio-reflection
# the image has these already (KINDS.md of the device tool lists its packages): its own versions serve
rm -f .whl/{anyio,annotated_doc,click,h11,idna,setuptools,typing_extensions}-*.whl
ls .whl
