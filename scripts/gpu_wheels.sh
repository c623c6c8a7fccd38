#!/usr/bin/env bash
# Fetch, here, the wheels that scripts/gpu_check.sh needs on the lent GPU machine, which has
# PyTorch and most of epd's needs but can fetch nothing: the versions this checkout's .venv
# runs, for that machine's Python 3.12 on x86-64, into .whl/ (ignored by git, carried by the
# device tool: carry [".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
rm -rf .whl
packages=(pyzmq msgspec fastapi starlette pydantic pydantic_core annotated-types annotated-doc
  typing-inspection typing_extensions opentelemetry-api uvicorn prometheus_client
  httpx httpcore h11 anyio sniffio idna certifi
  aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl)
pinned=()
for name in "${packages[@]}"; do
  pinned+=("$(.venv/bin/pip freeze 2>/dev/null | grep -i "^${name}==")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${pinned[@]}"
# llguidance: the newest wheel the registry has for that machine (this .venv's may be newer).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "llguidance>=1.0"
ls .whl
