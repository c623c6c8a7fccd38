#!/usr/bin/env bash
# Start epd's encode role (MoonViT + projector) on this node.
#
#   EPD_CONFIG=configs/multi-node.yaml EPD_GPU=0 scripts/launch_encode.sh
#
# Variables, besides the shared ones in scripts/launch_common.sh (EPD_CONFIG, EPD_MODEL, EPD_GPU,
# EPD_DEVICE, EPD_DTYPE, EPD_PYTHON):
#   EPD_BIND          ZeroMQ address that receives encode requests (tcp://0.0.0.0:7101)
#   EPD_PREFILLS      prefill addresses this role replies to, space-separated
#                     (tcp://PREFILL_NODE:7102, or a network: tcp://10.0.0.0/8:7102)
#   EPD_HEALTH_HOST   host of GET /health
#   EPD_HEALTH_PORT   port of GET /health
# Any other argument goes to `epd encode` as is (see `epd encode --help`).
set -euo pipefail
source "$(dirname "$0")/launch_common.sh"
flag --bind EPD_BIND
flags --prefills EPD_PREFILLS
flag --health-host EPD_HEALTH_HOST
flag --health-port EPD_HEALTH_PORT
run encode "$@"
