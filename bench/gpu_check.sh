#!/usr/bin/env bash
# The device check: what only a GPU can show, a table printed row by row as each check finishes, each
# check within its own budget (510 s in all on one H200; bench/gpu_check.py lists the rows and budgets).
# Stops in its first seconds, with the reason, when CUDA cannot be used.
#
#   bash bench/gpu_check.sh              # on a machine with a GPU (installs nothing: run `make test` first)
#   bash bench/gpu_check.sh --tiny       # the same rows on the CPU with tiny shapes: a smoke test of the script
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
if [ "${1:-}" = "--tiny" ]; then
    exec "$PY" -m bench.gpu_check "$@"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi failed" >&2
exec timeout 480 "$PY" -m bench.gpu_check "$@"  # a safety net: rows already printed stay printed
