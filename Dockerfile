# One image for every role; the container's command names the role (docker-compose.yml,
# deploy/kubernetes/). GPU nodes:  docker build -t epd:0.1.0-cuda .
# CPUs only (the CPU torch wheel, a much smaller image):  docker build --build-arg DEVICE=cpu .
FROM python:3.11.11-slim-bookworm

ARG DEVICE=cuda
ARG TORCH_VERSION=2.13.0
WORKDIR /app

# torch first, then the other dependencies (read from pyproject.toml), each in its own layer,
# so a change to the source rebuilds only the last layers.
RUN if [ "$DEVICE" = "cpu" ]; then \
      pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu; \
    else \
      pip install --no-cache-dir "torch==${TORCH_VERSION}"; \
    fi
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt \
 && pip install --no-cache-dir -r /tmp/requirements.txt
COPY epd ./epd
COPY configs ./configs
COPY checkpoints/kimi-vl-shapes ./checkpoints/kimi-vl-shapes
RUN pip install --no-cache-dir --no-deps .

# Not root. /keys is where compose mounts its ZeroMQ CURVE key volume (the image sets its
# owner); caches go to /tmp, so the root file system can be read-only (Kubernetes does so).
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp epd \
 && mkdir -m 700 /keys && chown epd:epd /keys
USER 10001
ENV HOME=/tmp HF_HOME=/tmp/hf EPD_LOG_LEVEL=INFO EPD_HEALTH_PORT=8000

# API, ZeroMQ (encode, prefill, decode), health and metrics (encode, decode)
EXPOSE 8000 7101 7102 7103 7111 7113
# /health/live fails only on a stall; set EPD_HEALTH_PORT to 7111 (encode) or 7113 (decode).
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
  CMD python -c "import os, urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{os.environ[\"EPD_HEALTH_PORT\"]}/health/live', timeout=4)"
ENTRYPOINT ["epd"]
