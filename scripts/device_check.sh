#!/usr/bin/env bash
# srt's checks on one GPU, in one run, every result written to one file.
#
#     OUT=/some/dir bash scripts/device_check.sh          # from the repository root
#     SRT_CHECK_LAYERS=2 bash scripts/device_check.sh     # a quick pass: 2 layers of the 8B shape
#
# For a single-GPU machine that has Python 3.12, torch with CUDA, Triton, transformers and
# safetensors installed and no network: srt's other wheels travel in .whl/ beside the working tree
# (scripts/device_wheels.sh fetches them) and install under /tmp/site. Then, each step bounded by
# `timeout` so the run ends inside one 10-minute command:
#   1. the GPU tests (tests/gpu: every attention backend against transformers on the same weights,
#      CUDA graphs against eager); flashinfer's kernels compile meanwhile in the background (nvcc
#      on first use, for sm90a), and its tests run last;
#   2. a random-weight checkpoint of Llama-3-8B's shape, made on the GPU (no weights travel);
#   3. bench_one_batch.py on it (batch 1, 8, 32; the batch-1 decode against the measured
#      read-bandwidth floor);
#   4. launch_server on it and bench_serving.py at concurrency 1, 32 and 128 (throughput, TTFT, ITL).
# Writes $OUT/device_check.txt (everything printed), and the benchmarks' JSON beside it. A failing
# step is reported and the next one still runs; the exit status is the number of failed steps.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_check}
LAYERS=${SRT_CHECK_LAYERS:-32}
MODEL=/tmp/srt_llama3_8b_$LAYERS
PORT=${SRT_CHECK_PORT:-30000}
BACKEND=${SRT_CHECK_BACKEND:-triton}  # the benchmarks' attention backend: the one CUDA graphs capture
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device_check.txt") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TOKENIZERS_PARALLELISM=false
failed=0
step() { echo; echo "=== $1 ($(date -u +%FT%TZ))"; }
run() {  # run SECONDS CMD...: CMD bounded by SECONDS; a failure is counted, not fatal
  local limit=$1; shift
  local start=$SECONDS
  timeout --signal=INT --kill-after=15 "$limit" "$@"
  local rc=$?
  echo "--- rc=$rc in $((SECONDS - start)) s: $*"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
  return "$rc"
}

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
git log -1 --format='srt %H %cd' 2>/dev/null || true
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=$PWD:/tmp/site
fi
python3 - <<'EOF'
import importlib, torch
print("python torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for name in ("triton", "transformers", "flashinfer", "fastapi", "uvicorn", "zmq"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as error:  # noqa: BLE001
        print(name, "missing:", error)
EOF

step "flashinfer: its kernels compile in the background (nvcc on first use), tested against torch_native"
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-6}
(
  timeout --signal=INT --kill-after=15 "${SRT_FLASHINFER_S:-420}" python3 -m pytest tests/test_flashinfer_backend.py \
    -v -p no:cacheprovider -o addopts= -k matches_torch_native >"$OUT/flashinfer.log" 2>&1
  echo "--- rc=$?" >>"$OUT/flashinfer.log"
) &
flashinfer_job=$!

step "GPU tests (flashinfer's once its kernels are built, at the end)"
run 300 python3 -m pytest tests/gpu tests/test_triton_attention.py tests/test_cuda_graph.py -v -p no:cacheprovider -o addopts= --timeout 280 -k "not flashinfer"

step "checkpoint: Llama-3-8B's shape, $LAYERS layers, random bf16"
run 240 python3 scripts/make_random_model.py "$MODEL" --llama3-8b --num-layers "$LAYERS" --device cuda

step "bench_one_batch"
run 240 python3 scripts/bench_one_batch.py --device cuda --attention-backend "$BACKEND" --model-path "$MODEL" --batch-size 1 8 32 \
  --input-len 512 --output-len 64 --runs 3 --json "$OUT/bench_one_batch.json"

step "bench_one_batch, batch 1 without CUDA graphs (what the graphs save)"
run 150 python3 scripts/bench_one_batch.py --device cuda --attention-backend "$BACKEND" --model-path "$MODEL" --batch-size 1 \
  --input-len 512 --output-len 64 --runs 3 --disable-cuda-graph

step "server and bench_serving"
python3 -m srt.launch_server --model-path "$MODEL" --device cuda --attention-backend "$BACKEND" --port "$PORT" \
  --max-running-requests 128 --context-length 2048 ${SRT_SERVER_FLAGS---cuda-graph-max-bs 128} >"$OUT/server.log" 2>&1 &
server=$!
ready=0
for _ in $(seq 1 120); do
  if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; then
    ready=1; break
  fi
  kill -0 "$server" 2>/dev/null || break
  sleep 2
done
if [ "$ready" = 1 ]; then
  for level in "1 16" "32 96" "128 256"; do  # concurrency, prompts: a few waves of each
    set -- $level
    run 150 python3 scripts/bench_serving.py --port "$PORT" --random-input-len 512 --random-output-len 128 \
      --num-prompts "$2" --concurrency "$1" --request-timeout 100 --json "$OUT/bench_serving_c$1.json"
  done
else
  echo "server did not become healthy"; failed=$((failed + 1))
fi
kill -INT "$server" 2>/dev/null; sleep 3; kill -KILL "$server" 2>/dev/null
echo "--- server log (tail)"; tail -n 40 "$OUT/server.log"

step "flashinfer (compiled in the background since the start)"
wait "$flashinfer_job"
cat "$OUT/flashinfer.log"
if grep -q -- "--- rc=0" "$OUT/flashinfer.log"; then
  run 200 python3 -m pytest tests/gpu -v -p no:cacheprovider -o addopts= --timeout 180 -k flashinfer
else
  failed=$((failed + 1))
fi

step "done: $failed failed step(s)"
exit "$failed"
