#!/usr/bin/env bash
# The engine's GPU checks, prepared for a machine with an NVIDIA GPU and a CUDA build of
# torch beside transformers (this project's own machine has neither; CI never runs this).
#
#   bash scripts/gpu_check.sh            # about 3 minutes on one GPU
#
# 1. conformance: bench/engine_throughput.py on the bundled sluice-tiny with
#    --device cuda --dtype float32 (TF32 off): its greedy completions must equal
#    transformers' on the same GPU (exit 1 otherwise), abort frees the blocks in a step;
# 2. throughput in bfloat16 (sluice serve's default on a GPU) at 64 and 256 requests,
#    against transformers' static batch on the same GPU, and one sequence at a time.
#
# It imports only the engine (sluice.engine) beside torch, transformers, safetensors,
# tokenizers, jinja2 and gguf, from src/ (no install): gguf (pure Python) is the one a
# stock PyTorch image may lack; put its wheel in .whl/ (git-ignored) to have it installed
# into a temporary folder first:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl gguf==0.19.0
# Record what it prints in the README's "On a GPU" section.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/sluice-site .whl/*.whl
    export PYTHONPATH=/tmp/sluice-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
"$python" - <<'EOF'
import sys
import torch

if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device")
print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
EOF
threads=$(($(nproc) > 8 ? 8 : $(nproc)))
echo "== conformance: float32 on the GPU, greedy output equal to transformers"
"$python" bench/engine_throughput.py --device cuda --dtype float32 --threads "$threads"
echo "== bfloat16, 64 requests"
"$python" bench/engine_throughput.py --device cuda --dtype bfloat16 --threads "$threads"
echo "== bfloat16, 256 requests"
"$python" bench/engine_throughput.py --device cuda --dtype bfloat16 --threads "$threads" \
    --requests 256 --max-running 256 --kv-blocks 4096 --max-batched-tokens 2048
