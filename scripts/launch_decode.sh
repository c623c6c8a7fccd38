#!/usr/bin/env bash
# Start epd's decode role (continuous batching over the KV hand-offs) on this node.
#
#   EPD_CONFIG=configs/multi-node.yaml EPD_GPU=0 scripts/launch_decode.sh
#
# Variables, besides the shared ones in scripts/launch_common.sh (EPD_CONFIG, EPD_MODEL, EPD_GPU,
# EPD_DEVICE, EPD_DTYPE, EPD_PYTHON):
#   EPD_BIND             ZeroMQ address that receives KV hand-offs (tcp://0.0.0.0:7103)
#   EPD_PREFILLS         prefill addresses this role replies to, space-separated
#                        (tcp://PREFILL_NODE:7102, or a network: tcp://10.0.0.0/8:7102)
#   EPD_HEALTH_HOST      host of GET /health
#   EPD_HEALTH_PORT      port of GET /health
#   EPD_MAX_BATCH_SIZE   most sequences per decode step
# Any other argument goes to `epd decode` as is (see `epd decode --help`).
set -euo pipefail
source "$(dirname "$0")/launch_common.sh"
flag --bind EPD_BIND
flags --prefills EPD_PREFILLS
flag --health-host EPD_HEALTH_HOST
flag --health-port EPD_HEALTH_PORT
flag --max-batch-size EPD_MAX_BATCH_SIZE
run decode "$@"
