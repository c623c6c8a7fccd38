#!/usr/bin/env bash
# The checks to run when a session is lent a machine with an NVIDIA GPU, in under 8 minutes:
#   1. epd on that machine's python3 and CUDA torch (missing packages from .whl/, made here by
#      scripts/gpu_wheels.sh: the lent machine can fetch nothing);
#   2. the unit suite, then the model on cuda against itself on the CPU (prefill, and batched
#      decode over a block pool, one row a sequence and three: a speculative verify step;
#      tiny checkpoint), in float32 and in bfloat16 (greedy tokens agree);
#   3. a random checkpoint at Kimi-VL-A3B's sizes in bfloat16 (drawn on the GPU), epd serve
#      with all three roles on cuda:0, and epd bench on text and image workloads.
# Prints absolute numbers; copy them, with the GPU's name, into docs/benchmarks.md.
#
#   scripts/gpu_wheels.sh                      # here, once
#   device run: scripts/gpu_check.sh [WORKDIR]   carry: [".whl"]   timeout_s: 600
set -euo pipefail
cd "$(dirname "$0")/.."
work="${1:-/tmp/epd-gpu-check}"
mkdir -p "$work"
started=$SECONDS
step() { echo; echo "== $1 ($((SECONDS - started)) s)"; }
export PYTHONUNBUFFERED=1

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$work/site" .whl/*.whl
fi
export PYTHONPATH="$PWD:$work/site${PYTHONPATH:+:$PYTHONPATH}"
py=python3
"$py" -c "import torch, zmq, msgspec, fastapi; assert torch.cuda.is_available(); \
print('torch', torch.__version__, torch.cuda.get_device_name())"

step "unit suite (no end-to-end processes)"
timeout 180 "$py" -m pytest -q -x -p no:cacheprovider --ignore=tests/e2e --ignore=tests/shapes \
  --ignore=tests/test_readme.py --ignore=tests/deploy --ignore=tests/bench \
  --ignore=tests/model/test_deepseek_oracle.py

step "the model on cuda against the CPU"
timeout 120 "$py" - "$work" "${EPD_CHECK_DEVICE:-cuda}" <<'EOF'
import sys, torch
from epd.checkpoint.synthetic import make_checkpoint
from epd.checkpoint.weights import load_model
from epd.kv.pool import BlockPool
ckpt = make_checkpoint(f"{sys.argv[1]}/tiny", "tiny")
prompts = [torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (13, 40)]
def run(device, dtype, rows):
    """Both prompts prefilled, then a decode step over a pool feeding `rows` tokens each (more
    than one: a speculative verify step) -> prefill's and the step's logits, on the CPU."""
    lm = load_model(ckpt, "language", device, dtype).language_model
    layers, width = lm.config.num_hidden_layers, lm.config.latent_dim
    pool = BlockPool(layers, width, torch.device(device), dtype, 4096)
    with torch.inference_mode():
        ids = [p.to(device) for p in prompts]
        hidden, cache = lm.prefill(lm.embed(torch.cat(ids)), [len(p) for p in ids])
        tables = [pool.table() for _ in ids]
        for table, own in zip(tables, cache.split([len(p) for p in ids], dim=1)):
            pool.write(table, own)
            pool.make_room(table, rows)
        fed = torch.tensor([7, 9, 11][:rows] * len(ids), device=device)
        batch = lm.block_reader().batch(pool.storage, tables, pool.max_bytes, [rows] * len(ids))
        step = lm.logits(lm.decode(fed, batch))
        return lm.logits(hidden).float().cpu(), step.float().cpu()
for rows in (1, 3):
    reference = run("cpu", torch.float32, rows)
    for dtype, bound in ((torch.float32, 1e-3), (torch.bfloat16, 5e-2)):
        for name, a, b in zip(("prefill", "decode"), reference, run(sys.argv[2], dtype, rows)):
            err = float((a - b).norm() / a.norm())
            agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
            print(f"{name} {dtype}, {rows} rows each: relative error {err:.2e}, "
                  f"greedy tokens agree {agree:.0%}")
            assert err < bound, (name, dtype, rows)
EOF

step "Kimi-VL-A3B sizes in bfloat16: make, serve, bench"
timeout 180 "$py" -m epd.cli make-checkpoint "$work/a3b" --preset a3b --dtype bfloat16 --device cuda
"$py" -m epd.cli serve --model "$work/a3b" --device cuda:0 --dtype bfloat16 \
  --port 8400 --internal-base-port 7500 > "$work/serve.log" 2>&1 &
serve=$!
trap 'kill $serve 2>/dev/null || true' EXIT
up=""
for _ in $(seq 180); do
  if curl -sf http://127.0.0.1:8400/v1/models > /dev/null; then up=1; break; fi
  kill -0 $serve 2>/dev/null || break
  sleep 1
done
[[ -n "$up" ]] || { echo "epd serve did not come up:"; tail -40 "$work/serve.log"; exit 1; }
bench() { timeout 120 "$py" -m epd.cli bench --base-url http://127.0.0.1:8400/v1 "$@"; }
for c in 1 32; do
  bench --concurrency $c --requests $((c > 4 ? c * 2 : 4)) --prompt-tokens 300 \
    --output-tokens 64 --json "$work/text-c$c.json"
done
for c in 1 8; do
  bench --concurrency $c --requests $((c > 4 ? c * 2 : 4)) --prompt-tokens 30 \
    --output-tokens 32 --images 1 --image-width 896 --image-height 896 --json "$work/image-c$c.json"
done
step "done"
