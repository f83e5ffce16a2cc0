#!/usr/bin/env bash
# A GPU loan's checks in one call (see bench/README.md): the `cuda` tests, then the GPU benches.
#   bash bench/device_check.sh OUT_DIR [tests|spec|graphs|api ...]   (default: the first three, in that order)
# `api` runs the servers' CUDA tests (CUDA IPC pushes, NCCL groups). The device image lacks the server's web and
# Redis packages: `bash bench/device_wheels.sh` puts them in .whl/ here first, and the call carries `.whl`.
# Writes cuda_tests.log, spec_decode_cuda.json with its four PNGs and the adaptive runs' strategy traces
# (traces/: per decode step the arm, its seconds and the host ms around the forwards), cuda_graphs.json and
# bench.log (the benches' stderr) into OUT_DIR. Each stage has its own time limit, so one that hangs leaves the others
# their time and what it wrote comes back. The three limits add up to 580 s, inside the device tool's 600 s a call.
set -uo pipefail
out=${1:?usage: device_check.sh OUT_DIR [tests|spec|graphs ...]}
shift
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(tests spec graphs)
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
mkdir -p "$out"
nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
status=0
for stage in "${stages[@]}"; do
  start=$(date +%s)
  case $stage in
    tests)  # 134-142 s on an H100 at d0c9727
      timeout 170 python3 -m pytest -q -p no:cacheprovider -m cuda --timeout 150 tests/engine 2>&1 \
        | tee "$out/cuda_tests.log" ;;
    spec)  # 172 s
      timeout 210 python3 -m bench.spec_decode --device cuda --plot-dir "$out" --strategy-trace "$out/traces" \
        >"$out/spec_decode_cuda.json" 2>>"$out/bench.log" ;;
    graphs)  # ~175 s (eager adaptive is slow there); partial results survive the limit (`complete`: false)
      timeout 200 python3 -m bench.cuda_graphs --out "$out/cuda_graphs.json" >/dev/null 2>>"$out/bench.log" ;;
    api)  # ~40 s on an H200 (the NCCL tests skip on one GPU)
      site=$(mktemp -d)
      if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl
      fi
      PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 240 python3 -m pytest -q -p no:cacheprovider -rs \
        --timeout 200 tests/api/test_weight_cuda_ipc.py tests/api/test_weight_collective_cuda.py 2>&1 \
        | tee "$out/api_tests.log" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
  rc=$?
  echo "stage $stage: rc $rc in $(( $(date +%s) - start )) s"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
