#!/usr/bin/env bash
# What only a GPU can show, as one table, in under 8 minutes on one GPU (bench/gpu_check.py says what
# each row measures): check_pfc through NCCL, 200 steps of r50 fp16 with two views and with one view on
# JPEG records packed on the spot, dali=True, bitwise resume with deterministic=True, PartialFC at 1M
# and 4M classes, the memory plan against real steps (r50, vit_b), GPU-decoded batches against CPU-decoded
# ones.
#
#   bash bench/gpu_check.sh              # on a machine with a GPU (installs nothing: run `make test` first)
#   bash bench/gpu_check.sh --tiny       # the same rows on the CPU with tiny shapes: a smoke test of the script
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
if [ "${1:-}" != "--tiny" ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
timeout 480 "$PY" -m bench.gpu_check "$@"
