#!/usr/bin/env bash
# The checks to run on a machine with an NVIDIA GPU, in under 8 minutes (DEVELOPERS.md says when):
#   1. a virtual environment with CUDA torch and epd (the CPU wheel is for machines without one);
#   2. the unit suite on that install, then the model on cuda against itself on the CPU
#      (prefill and batched decode, tiny checkpoint, float32);
#   3. a random checkpoint at Kimi-VL-A3B's sizes in bfloat16 (drawn on the GPU), epd serve with
#      all three roles on cuda:0, and epd bench on text and image workloads.
# Prints absolute numbers; copy them into docs/benchmarks.md with the GPU's name.
#
#   scripts/gpu_check.sh [WORKDIR]     # default /tmp/epd-gpu-check
set -euo pipefail
cd "$(dirname "$0")/.."
work="${1:-/tmp/epd-gpu-check}"
mkdir -p "$work"
started=$SECONDS
step() { echo; echo "== $1 ($((SECONDS - started)) s)"; }

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q torch
"$py" -m pip install -q -e '.[dev]'
"$py" -c "import torch; assert torch.cuda.is_available(); print('torch', torch.__version__, torch.cuda.get_device_name())"

step "unit suite (no end-to-end processes)"
"$py" -m pytest -q -x --ignore=tests/e2e --ignore=tests/shapes --ignore=tests/test_readme.py

step "the model on cuda equals the model on the CPU"
"$py" - "$work" <<'EOF'
import sys, torch
from epd.checkpoint.synthetic import make_checkpoint
from epd.checkpoint.weights import load_model
ckpt = make_checkpoint(f"{sys.argv[1]}/tiny", "tiny")
prompts = [torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (13, 40)]
outputs = {}
for device in ("cpu", "cuda"):
    lm = load_model(ckpt, "language", device, torch.float32).language_model
    with torch.inference_mode():
        ids = [p.to(device) for p in prompts]
        hidden, cache = lm.prefill(lm.embed(torch.cat(ids)), [len(p) for p in ids])
        caches = cache.split([len(p) for p in ids])
        step = lm.logits(lm.decode(torch.tensor([7, 9], device=device), caches))
        outputs[device] = (lm.logits(hidden).cpu(), step.cpu())
for name, a, b in zip(("prefill", "decode"), outputs["cpu"], outputs["cuda"]):
    err = float((a - b).norm() / a.norm())
    print(f"{name} logits, cuda against cpu: relative error {err:.2e}")
    assert err < 1e-3, name
EOF

step "Kimi-VL-A3B sizes in bfloat16: make, serve, bench"
"$py" -m epd.cli make-checkpoint "$work/a3b" --preset a3b --dtype bfloat16 --device cuda
"$py" -m epd.cli serve --model "$work/a3b" --device cuda:0 --dtype bfloat16 \
  --port 8400 --internal-base-port 7500 > "$work/serve.log" 2>&1 &
serve=$!
trap 'kill $serve 2>/dev/null || true' EXIT
for _ in $(seq 240); do
  curl -sf http://127.0.0.1:8400/v1/models > /dev/null && break
  kill -0 $serve 2>/dev/null || { tail -30 "$work/serve.log"; exit 1; }
  sleep 1
done
bench() { "$py" -m epd.cli bench --base-url http://127.0.0.1:8400/v1 "$@" 2>/dev/null | grep -v "^requests:"; }
for c in 1 16 64; do
  bench --concurrency $c --requests $((c * 2 > 8 ? c * 2 : 8)) --prompt-tokens 900 --output-tokens 128 \
    --json "$work/text-c$c.json"
done
for c in 1 8; do
  bench --concurrency $c --requests $((c * 2 > 8 ? c * 2 : 8)) --prompt-tokens 50 --output-tokens 64 \
    --images 1 --image-width 896 --image-height 896 --json "$work/image-c$c.json"
done
step "done"
