# syntax=docker/dockerfile:1
# kvgate: KV-cache-aware admission gateway in front of vLLM.
#   docker build -t kvgate:0.1.0 .
#   docker run --rm -p 8080:8080 -p 9090:9090 -e KVGATE_UPSTREAM=http://vllm:8000 \
#     -v "$PWD/kvgate.yaml:/etc/kvgate/kvgate.yaml:ro" kvgate:0.1.0
# Flags after the image name replace the default CMD (so repeat --config /etc/kvgate/kvgate.yaml with them).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: resolve and install kvgate and its runtime dependencies into a self-contained venv ----
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/kvgate
WORKDIR /src
# The project metadata first, so the dependency layer is rebuilt only when pyproject.toml changes.
COPY pyproject.toml README.md ./
COPY gateway ./gateway
# A non-editable install: the venv holds the package itself, so the runtime stage needs no source tree.
RUN /opt/kvgate/bin/pip install --no-cache-dir . \
    && /opt/kvgate/bin/python -c "import gateway.cli"

# ---- runtime: the venv only, no compiler, no pip cache, no source ----
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="kvgate" \
      org.opencontainers.image.description="KV-cache-aware admission gateway in front of vLLM" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 kvgate \
    && useradd --system --uid 10001 --gid kvgate --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin kvgate
COPY --from=build /opt/kvgate /opt/kvgate
# A default policy so the image starts on its own; mount a ConfigMap or file over /etc/kvgate to replace it.
COPY deploy/base/kvgate.yaml /etc/kvgate/kvgate.yaml
ENV PATH=/opt/kvgate/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    KVGATE_PORT=8080
USER 10001:10001
# 8080: clients; 9090: /readyz and /metrics (the default policy's listen.control_port; /healthz on both)
EXPOSE 8080 9090
# slim has no curl: probe /healthz with the standard library. Exit 0 only on HTTP 200.
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request as u; r = u.urlopen('http://127.0.0.1:%s/healthz' % (os.environ.get('KVGATE_CONTROL_PORT') or os.environ.get('KVGATE_PORT', '8080')), timeout=2); sys.exit(0 if r.status == 200 else 1)"]
# Configuration, lowest precedence first: the mounted file (CMD's --config), then KVGATE_* variables, then
# flags given to `docker run`. sh only maps the variables to flags and then execs kvgate, so kvgate is PID 1
# and receives SIGTERM directly, which starts its graceful drain. KVGATE_PORT also tells HEALTHCHECK the port
# (KVGATE_CONTROL_PORT, when set: /healthz answers on both, but only the control port ignores max_connections).
# KVGATE_UPSTREAM (one URL, or several separated by commas: a pool) is read by kvgate itself, and used only
# when no --upstream is given: --upstream repeats to make a pool, so a flag could not replace a mapped one.
ENTRYPOINT ["/bin/sh", "-c", "exec kvgate serve ${KVGATE_PORT:+--port \"$KVGATE_PORT\"} ${KVGATE_CONTROL_PORT:+--control-port \"$KVGATE_CONTROL_PORT\"} ${KVGATE_TOKENIZER:+--tokenizer \"$KVGATE_TOKENIZER\"} ${KVGATE_LOG_LEVEL:+--log-level \"$KVGATE_LOG_LEVEL\"} \"$@\"", "kvgate"]
CMD ["--config", "/etc/kvgate/kvgate.yaml"]
