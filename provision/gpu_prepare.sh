# Sourced by gpu_acceptance/gpu_check.sh and gpu_acceptance/gpu_throughput.sh, in the checkout's root, with `tiny` set to (--tiny) or
# (): which Python and torch run them and (unless --tiny) whether CUDA can run a kernel; the small packages their
# benches import that a GPU image may lack, installed from .gpu-wheels/ into .gpu-site/ and put on PYTHONPATH;
# the GPU, its memory and driver named. Exits 2 with the reason when something is missing.
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
"$PY" -m gpu_acceptance.gpu_ready "${tiny[@]}" || exit 2
site="$PWD/${GPU_SITE:-.gpu-site}"
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -m provision.gpu_wheels --wheels "${GPU_WHEELS:-.gpu-wheels}" --target "$site" "${tiny[@]}" || exit 2
if [ ${#tiny[@]} = 0 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi failed" >&2
fi
