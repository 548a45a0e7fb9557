# prefixpin in front of a llama-server or Ollama (no embedded engine: that extra compiles
# llama.cpp). Build from the repository root:  docker build -t prefixpin .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what the package needs: the image does not change when tests or benches do.
COPY pyproject.toml README.md ./
COPY core ./core
COPY proxy ./proxy
COPY adapters ./adapters
COPY fingerprint ./fingerprint
COPY prefixpin ./prefixpin
RUN pip install ".[replicas]" && rm -rf /src

# Parked sessions and other state live here (mount a volume to keep them).
RUN useradd --system --create-home --home-dir /var/lib/prefixpin prefixpin
USER prefixpin
WORKDIR /var/lib/prefixpin

# Two listeners: tenants on 8088 (the pipeline's routes and a read-only allow-list of
# engine paths), the operator on 8089 (status page, /sessions, /metrics, every engine path
# such as /slots). The operator listener stays on the container's loopback unless
# PREFIXPIN_ADMIN_LISTEN=0.0.0.0:8089 publishes it, which needs PREFIXPIN_ADMIN_TOKEN too
# (without one prefixpin refuses to start): deploy/compose.yaml does both.
ENV PREFIXPIN_HOST=0.0.0.0 PREFIXPIN_PORT=8088 PREFIXPIN_ADMIN_LISTEN=127.0.0.1:8089
EXPOSE 8088 8089

# /healthz answers 503 while the engine is unreachable: the container is healthy only
# when requests can go through.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8088/healthz', timeout=4).status != 200)"]

ENTRYPOINT ["prefixpin"]
CMD ["serve"]
