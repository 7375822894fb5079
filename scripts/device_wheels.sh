#!/usr/bin/env bash
# Fetches, into .whl/ (git-ignored through .git/info/exclude), the wheels srt needs on a GPU machine
# whose image has torch, Triton and transformers but not srt's serving stack: scripts/device_check.sh
# installs them there without a network. flashinfer (the cuda extra) comes with its one missing
# import, apache-tvm-ffi; it compiles its kernels there with nvcc on first use. Run here, from the repository root, with PyPI reachable.
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 -d .whl \
  pyzmq==27.3.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic_core==2.46.4 \
  annotated-types==0.7.0 typing-inspection==0.4.2 uvicorn==0.55.0 httptools==0.9.0 orjson==3.13.0 \
  setproctitle==1.3.8 opentelemetry-api==1.45.2 \
  flashinfer-python==0.5.3 apache-tvm-ffi==0.1.15.post2 --platform manylinux_2_24_x86_64 "$@"
du -sh .whl
