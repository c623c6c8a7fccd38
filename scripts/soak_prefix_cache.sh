#!/usr/bin/env bash
# A mixed soak for the prefix caches: do they stay within their budgets, and prefill's and
# decode's memory flat?
#
#   scripts/soak_prefix_cache.sh [MINUTES] [BUDGET_BYTES] [MODEL]
#
# Starts `epd serve` with --prefix-cache-bytes BUDGET (default 64 MiB: small, so that it fills
# and evicts), then for MINUTES (default 30) runs `epd bench` workloads in turn: conversations
# with an image, 8 streams sharing a system prompt, and prompts that share nothing. Every 15 s
# it prints prefill's cache (bytes, cached tokens, hit rate, from /health), decode's pool (bytes,
# cached tokens, blocks held, from its /health) and both processes' resident memory.
set -euo pipefail
minutes=${1:-30}
budget=${2:-67108864}
model=${3:-checkpoints/kimi-vl-shapes}
port=8750
cd "$(dirname "$0")/.."
python=.venv/bin/python
$python -m epd.cli serve --model "$model" --port $port --internal-base-port 7750 \
  --prefix-cache-bytes "$budget" > /tmp/soak_serve.log 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
until curl -sf http://127.0.0.1:$port/health > /dev/null; do sleep 1; done
prefill=$(pgrep -f "epd.cli prefill.*--port $port" | head -1)
decode=$(pgrep -f "epd.cli decode.*--health-port 7762" | head -1)

sample() {
  while true; do
    cache=$(curl -sf http://127.0.0.1:$port/health | $python -c \
      'import json,sys; c=json.load(sys.stdin)["prefix_cache"]; print(c["bytes"], c["cached_tokens"], c["hit_rate"])')
    pool=$(curl -sf http://127.0.0.1:7762/health | $python -c \
      'import json,sys; c=json.load(sys.stdin)["kv_cache"]; print(c["bytes"], c["cached_tokens"], c["used_blocks"])')
    rss=$(awk '/VmRSS/ {print int($2 / 1024)}' /proc/"$prefill"/status)
    decode_rss=$(awk '/VmRSS/ {print int($2 / 1024)}' /proc/"$decode"/status)
    echo "$(date +%T) prefill cache bytes/tokens/hit_rate: $cache  rss_mb: $rss" \
      " decode pool bytes/cached_tokens/used_blocks: $pool  rss_mb: $decode_rss"
    sleep 15
  done
}
sample &
sampler=$!
trap 'kill $sampler 2>/dev/null; kill -INT $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT

bench() { $python -m epd.cli bench --base-url http://127.0.0.1:$port/v1 "$@" 2>/dev/null \
  | grep -E "completed" || true; }
end=$((SECONDS + minutes * 60))
seed=0
while [ $SECONDS -lt $end ]; do
  seed=$((seed + 1))
  bench --seed $seed --system-prompt-tokens 600 --images 1 --turns 3 --requests 9 \
    --prompt-tokens 30 --output-tokens 16 --concurrency 2
  bench --seed $seed --system-prompt-tokens 800 --requests 16 --prompt-tokens 30 \
    --output-tokens 16 --concurrency 8
  bench --seed $seed --requests 16 --prompt-tokens 200 --output-tokens 16 --concurrency 4
done
