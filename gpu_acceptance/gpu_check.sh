#!/usr/bin/env bash
# The device check: what only a GPU can show, a table printed row by row as each check finishes, each
# check within its own budget (gpu_acceptance/gpu_check.py lists the rows and budgets: 425 s in all on one H200,
# under a limit of 440 s, all inside this script's 470 s). Needs only a python3 with torch: the few small
# packages the rows import that a GPU image may lack (provision/gpu_wheels.txt) are installed from
# .gpu-wheels/, which `bash provision/fetch_gpu_wheels.sh` fills on a machine with a package registry.
# Stops in its first seconds, with the reason, when torch, CUDA or a wheel is missing. Exits 1 when a
# row failed or did not run (the last line names them).
#
#   bash gpu_acceptance/gpu_check.sh              # on a machine with a GPU
#   bash gpu_acceptance/gpu_check.sh --tiny       # the same rows on the CPU with tiny shapes: a rehearsal of the script
#   bash gpu_acceptance/gpu_check.sh --only data "train 2 views"    # some checks alone
set -euo pipefail
cd "$(dirname "$0")/.."
NET_SECONDS=470  # a hung check stops here, under 8 minutes; gpu_acceptance/gpu_check.py stops itself earlier
TINY_SLACK=4     # gpu_acceptance/gpu_check.py's: a loaded CPU is slower than an H200
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
net=$NET_SECONDS tiny=()
for argument in "$@"; do
    if [ "$argument" = "--tiny" ]; then net=$((NET_SECONDS * TINY_SLACK)) tiny=(--tiny); fi
done

. provision/gpu_prepare.sh
status=0
timeout --kill-after=10 "$net" "$PY" -m gpu_acceptance.gpu_check "$@" || status=$?
if [ "$status" = 124 ] || [ "$status" = 137 ]; then
    echo "gpu check: stopped at its outer limit of $net s: the rows not printed above did not run" >&2
fi
exit "$status"
