# specroll rollout server.
#   docker build -t specroll .                                   # CPU
#   docker build -t specroll:cuda --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#   docker run -p 8000:8000 -p 50051:50051 -e SPECROLL_ADMIN_TOKEN=... specroll [--model /models/x]
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1 PYTHONUNBUFFERED=1 \
    SPECROLL_CACHE=/opt/specroll/cache SPECROLL_HOST=0.0.0.0 SPECROLL_HTTP_PORT=8000 SPECROLL_GRPC_PORT=50051

RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-pip && \
        rm -rf /var/lib/apt/lists/*; \
    fi && \
    useradd --create-home --uid 10001 specroll && mkdir -p /opt/specroll/cache && chown -R specroll /opt/specroll

WORKDIR /opt/specroll/app
# Dependencies first, so code changes do not reinstall torch.
COPY pyproject.toml README.md ./
RUN python3 -m pip install --index-url ${TORCH_INDEX} torch==2.13.0 && \
    python3 -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb')); \
print('\n'.join(x for x in d['project']['dependencies'] if not x.startswith('torch')))" > /tmp/req.txt && \
    python3 -m pip install -r /tmp/req.txt

COPY proto ./proto
COPY service ./service
COPY client ./client
COPY drafter_trainer ./drafter_trainer
RUN python3 -m pip install --no-deps -e . && \
    python3 -m service.api.protogen && \
    specroll build-default-model && \
    chown -R specroll /opt/specroll

USER specroll
EXPOSE 8000 50051
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s \
    CMD python3 -c "import urllib.request, sys; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" || exit 1
ENTRYPOINT ["specroll", "serve"]
