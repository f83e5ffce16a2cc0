# specroll rollout server (CPU). The CUDA variant is deploy/docker/Dockerfile.cuda.
#   docker build -t specroll .
#   docker run -p 8000:8000 -p 50051:50051 -e SPECROLL_ADMIN_TOKEN_FILE=/run/secrets/admin-token ... specroll
#   docker run ... specroll drafter-trainer --server specroll:50051 ...       (the sidecar, same image)
# Air-gapped build (no registry, no download.pytorch.org): a local base and a local wheel folder, e.g.
#   deploy/docker/build-base.sh specroll-base:bookworm
#   python3 -m http.server -d /opt/wheels 8765 &    # any folder/URL holding torch-2.13.0+cpu-*.whl
#   docker build --network host --build-arg BASE=specroll-base:bookworm --build-arg TORCH_INDEX= \
#       --build-arg PIP_FIND_LINKS=http://127.0.0.1:8765/ -t specroll .
# The default model's weights ship inside the package (service/demo/weights): nothing is downloaded at start.
# COMPILER=1 (default): the image holds a C++ compiler and Python's headers, for torch.compile's CPU code and the
# cpp attention kernel; the engine's compiled forwards serve the demo model at 1.35-1.5x the eager ones' tokens/s
# (service/engine/compiled.py). COMPILER=0: no compiler (smaller), every forward eager.
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG COMPILER=1

# TORCH_INDEX empty: the torch wheel comes from PIP_FIND_LINKS (a folder in the context or a URL), its
# dependencies and the others from PIP_INDEX_URL (a PyPI mirror in an air-gapped cluster).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=
ARG PIP_INDEX_URL=https://pypi.org/simple
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore \
    PYTHONUNBUFFERED=1 SPECROLL_CACHE=/opt/specroll/cache SPECROLL_HOST=0.0.0.0 SPECROLL_HTTP_PORT=8000 \
    SPECROLL_GRPC_PORT=50051 TORCHINDUCTOR_CACHE_DIR=/opt/specroll/cache/inductor

RUN pkgs=""; \
    if ! command -v python3 >/dev/null || ! python3 -m pip --version >/dev/null 2>&1; then pkgs="python3 python3-pip"; fi; \
    if [ "$COMPILER" = 1 ]; then \
        pkgs="$pkgs g++"; \
        python3 -c "import sysconfig, pathlib, sys; \
sys.exit(not (pathlib.Path(sysconfig.get_paths()['include']) / 'Python.h').is_file())" 2>/dev/null || \
            pkgs="$pkgs python3-dev"; \
    fi; \
    if [ -n "$pkgs" ]; then \
        apt-get update && apt-get install -y --no-install-recommends $pkgs && apt-get clean && \
        rm -rf /var/lib/apt/lists/*; \
    fi && \
    useradd --create-home --uid 10001 specroll && mkdir -p /opt/specroll/cache /opt/specroll/checkpoints && chown -R specroll /opt/specroll

WORKDIR /opt/specroll/app
# Dependencies first (torch before anything is copied), so code or pyproject changes do not reinstall torch.
RUN if [ -n "$TORCH_INDEX" ]; then \
        env -u PIP_FIND_LINKS python3 -m pip install --index-url "$TORCH_INDEX" torch==2.13.0; \
    else \
        env -u PIP_FIND_LINKS python3 -m pip install --no-index --no-deps --find-links "$PIP_FIND_LINKS" torch==2.13.0; \
    fi
COPY pyproject.toml README.md ./
RUN python3 -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb')); \
print('\n'.join(x for x in d['project']['dependencies']))" > /tmp/req.txt && \
    env -u PIP_FIND_LINKS python3 -m pip install --index-url "$PIP_INDEX_URL" -r /tmp/req.txt

COPY proto ./proto
COPY service ./service
COPY client ./client
COPY drafter_trainer ./drafter_trainer
COPY deploy/docker/entrypoint.sh /usr/local/bin/specroll-entrypoint
# With a compiler: time the kernels and compile the default model's forwards (and build the cpp kernel) now, into
# the image's caches (service/models/remembered.py), so a container on a CPU like the build's serves compiled
# forwards after ~45 s of tracing them in the background (eager ones until then) instead of 2-3 minutes of
# compiling (2 cores). On another CPU the caches miss (keyed by its
# features) and the server times and compiles at start-up. (Not inductor's precompiled header, 150 MB in /tmp,
# which only speeds up compiling.)
RUN env -u PIP_FIND_LINKS python3 -m pip install --no-deps -e . && \
    python3 -m client.protogen && \
    specroll build-default-model && \
    if [ "$COMPILER" = 1 ]; then \
        specroll generate --drafter auto --prompt 1+2= --max-tokens 8 > /dev/null && rm -rf /tmp/torchinductor_*; \
    fi && \
    chown -R specroll /opt/specroll

USER specroll
EXPOSE 8000 50051
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD python3 -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' \
% os.environ.get('SPECROLL_HTTP_PORT', '8000'), timeout=2)" || exit 1
ENTRYPOINT ["specroll-entrypoint"]
