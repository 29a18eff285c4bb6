"""The device check's first seconds (gpu_acceptance/gpu_check.sh): which Python and torch run it and, unless
`--tiny`, whether CUDA can run a kernel here. One line saying why and exit 2 when not, before anything
slow is imported (torch and utils.device only).

    python3 -m gpu_acceptance.gpu_ready [--tiny]
"""
from __future__ import annotations

import sys


def cuda_problem() -> str | None:
    """Why CUDA cannot run the check, or None: no usable driver, or a GPU that cannot run a kernel."""
    import torch  # noqa: PLC0415 (main reports a missing torch as one line)

    from utils.device import cuda_unavailable_reason  # noqa: PLC0415 (imports torch)

    if not torch.cuda.is_available():
        return cuda_unavailable_reason()
    try:
        torch.ones(1, device="cuda").add_(1).item()
    except RuntimeError as error:
        return f"a first CUDA operation failed: {str(error).splitlines()[0]}"
    return None


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        import torch  # noqa: PLC0415 (a missing torch is this check's first finding)
    except ImportError as error:
        print(f"gpu check: error: {sys.executable} cannot import torch ({type(error).__name__}: {error}); run with "
              "PY=<a python that has torch>", file=sys.stderr)
        return 2
    print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, built for CUDA {torch.version.cuda}")
    if "--tiny" not in args and (problem := cuda_problem()) is not None:
        print(f"gpu check: error: CUDA cannot be used, so nothing here can be checked: {problem}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
