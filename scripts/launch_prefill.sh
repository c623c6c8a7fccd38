#!/usr/bin/env bash
# Start epd's prefill role, which also serves the OpenAI API, on this node.
#
#   EPD_CONFIG=configs/multi-node.yaml EPD_GPU=0 scripts/launch_prefill.sh
#
# Variables, besides the shared ones in scripts/launch_common.sh (EPD_CONFIG, EPD_MODEL, EPD_GPU,
# EPD_DEVICE, EPD_DTYPE, EPD_PYTHON):
#   EPD_HOST, EPD_PORT   where the OpenAI API listens (0.0.0.0, 8000)
#   EPD_BIND             ZeroMQ address that receives embeddings and tokens (tcp://0.0.0.0:7102)
#   EPD_ADVERTISE        the address encode and decode reply to (tcp://THIS_NODE:7102)
#   EPD_ENCODERS         encode addresses, space-separated (tcp://ENCODE_NODE:7101 ...)
#   EPD_DECODERS         decode addresses, space-separated (tcp://DECODE_NODE:7103 ...)
#   EPD_SERVED_MODEL_NAME  the model name clients use
# Any other argument goes to `epd prefill` as is (see `epd prefill --help`).
set -euo pipefail
source "$(dirname "$0")/launch_common.sh"
flag --host EPD_HOST
flag --port EPD_PORT
flag --bind EPD_BIND
flag --advertise EPD_ADVERTISE
flags --encoders EPD_ENCODERS
flags --decoders EPD_DECODERS
flag --served-model-name EPD_SERVED_MODEL_NAME
run prefill "$@"
