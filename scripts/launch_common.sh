# Sourced by launch_encode.sh, launch_prefill.sh and launch_decode.sh: turns EPD_* environment
# variables into `epd` flags, selects the GPU and finds the Python that has epd installed.
#
# Shared variables (every role):
#   EPD_CONFIG   YAML config file, e.g. configs/multi-node.yaml (flags from variables win over it)
#   EPD_MODEL    checkpoint directory
#   EPD_GPU      GPU index for this role: sets CUDA_VISIBLE_DEVICES, so the device is cuda:0
#   EPD_DEVICE   torch device (cpu, cuda:0, ...)
#   EPD_DTYPE    auto, float32, bfloat16 or float16
#   EPD_THREADS  torch threads for this role (default: the node's cores; 4 on a GPU)
#   EPD_PYTHON   Python with epd installed (default: this checkout's .venv, else python3)

epd_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ -n "${EPD_GPU:-}" ]]; then
  export CUDA_VISIBLE_DEVICES="$EPD_GPU"
fi

if [[ -n "${EPD_PYTHON:-}" ]]; then
  epd_python="$EPD_PYTHON"
elif [[ -x "$epd_root/.venv/bin/python" ]]; then
  epd_python="$epd_root/.venv/bin/python"
else
  epd_python=python3
fi

epd_flags=()

# flag --name VARIABLE: pass --name "$VARIABLE" when the variable is set.
flag() {
  local value="${!2:-}"
  if [[ -n "$value" ]]; then epd_flags+=("$1" "$value"); fi
}

# flags --name VARIABLE: a space-separated list, passed as --name a b c.
flags() {
  local value="${!2:-}"
  if [[ -n "$value" ]]; then
    read -r -a items <<< "$value"
    epd_flags+=("$1" "${items[@]}")
  fi
}

flag --config EPD_CONFIG
flag --model EPD_MODEL
flag --device EPD_DEVICE
flag --dtype EPD_DTYPE
flag --threads EPD_THREADS

# run ROLE ARGS...: replace this shell with the role's process.
run() {
  local role="$1"
  shift
  exec "$epd_python" -m epd.cli "$role" "${epd_flags[@]}" "$@"
}
