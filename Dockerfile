# One image for every role; the container's command names the role (see docker-compose.yml).
FROM python:3.11-slim

WORKDIR /app
# torch from PyPI is the CUDA build on x86_64 Linux; it also runs on CPUs (docker-compose.cpu.yml).
RUN pip install --no-cache-dir torch
COPY pyproject.toml README.md ./
COPY epd ./epd
COPY configs ./configs
RUN pip install --no-cache-dir .

# The compose file mounts its ZeroMQ CURVE key volume here; the image sets its owner.
RUN mkdir -m 700 /keys
ENV EPD_LOG_LEVEL=INFO
# API, ZeroMQ (encode, prefill, decode), health (encode, decode)
EXPOSE 8000 7101 7102 7103 7111 7113
ENTRYPOINT ["epd"]
