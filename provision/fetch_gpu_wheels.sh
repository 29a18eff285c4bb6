#!/usr/bin/env bash
# Downloads the wheels the device check needs on a GPU machine without a package registry
# (provision/gpu_wheels.txt) into .gpu-wheels/ (ignored by git; bring it along with the checkout).
#
#   bash provision/fetch_gpu_wheels.sh                       # for the GPU machine's Python 3.12
#   PYTHON_VERSION=3.11 bash provision/fetch_gpu_wheels.sh   # for another Python
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
version=${PYTHON_VERSION:-3.12}
mapfile -t requirements < <(sed 's/#.*//' provision/gpu_wheels.txt | awk 'NF { print $2 }')
"$PY" -m pip download --quiet --only-binary=:all: --no-deps --dest .gpu-wheels \
    --python-version "$version" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any \
    "${requirements[@]}"
echo "wheels for Python $version in .gpu-wheels/: $(ls .gpu-wheels | wc -l) files, $(du -sh .gpu-wheels | cut -f1)"
