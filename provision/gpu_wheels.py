"""Makes a bare GPU machine ready for the device check: every module of provision/gpu_wheels.txt that this
Python cannot import is installed from the wheels provision/fetch_gpu_wheels.sh downloaded (no package
registry is needed, nor reachable there), into a folder of its own that the check puts on PYTHONPATH.

    python3 -m provision.gpu_wheels --wheels .gpu-wheels --target .gpu-site [--tiny]

Standard library only: it runs before anything the wheels provide. One `error:` line and exit 1 when
a wheel is missing or pip cannot install it.
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

LIST = Path(__file__).resolve().with_name("gpu_wheels.txt")
FETCH = "bash provision/fetch_gpu_wheels.sh"


def read_list(path: Path, tiny: bool = False) -> list[tuple[str, str]]:
    """(module, requirement) of each line of `path`, comments dropped; with `tiny`, not those marked gpu."""
    entries = []
    for line in path.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if fields and not (tiny and fields[2:] == ["gpu"]):
            entries.append((fields[0], fields[1]))
    return entries


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def wheel_for(requirement: str, wheels: Path) -> Path | None:
    """The wheel of `requirement`'s distribution in `wheels` (names as wheels spell them: lower case, '_')."""
    name = re.split(r"[=<>!~;\[ ]", requirement, maxsplit=1)[0]
    stem = re.sub(r"[-_.]+", "_", name).lower()
    found = sorted(path for path in wheels.glob("*.whl") if path.name.lower().startswith(f"{stem}-") and fits(path))
    return found[-1] if found else None


def fits(wheel: Path) -> bool:
    """Whether `wheel`'s Python tag is this interpreter's (the folder may hold wheels for several)."""
    python, abi = wheel.stem.split("-")[-3:-1]
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return abi == "abi3" or any(tag in ("py3", here) for tag in python.split("."))


def missing_modules(entries: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(module, requirement) for module, requirement in entries if not importable(module)]


def install(missing: list[tuple[str, str]], wheels: Path, target: Path) -> str | None:
    """Install the wheels of `missing` into `target`; why not, or None."""
    found = {requirement: wheel_for(requirement, wheels) for _, requirement in missing}
    absent = [f"{requirement} (for {module})" for module, requirement in missing if found[requirement] is None]
    if absent:
        return (f"this Python cannot import {', '.join(module for module, _ in missing)} and {wheels} has no wheel "
                f"of {', '.join(absent)}: run `{FETCH}` on a machine with a package registry and bring {wheels} along")
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target", str(target),
               *map(str, found.values())]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except OSError as error:
        return f"could not run pip ({error})"
    if done.returncode:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        return f"pip could not install {', '.join(found[r].name for _, r in missing)}: {lines[-1] if lines else ''}"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, default=Path(".gpu-wheels"), help="the downloaded wheels")
    parser.add_argument("--target", type=Path, default=Path(".gpu-site"), help="where to install (put on PYTHONPATH)")
    parser.add_argument("--list", type=Path, default=LIST, help="module and requirement, one pair a line")
    parser.add_argument("--tiny", action="store_true", help="only what `gpu_check --tiny` imports")
    args = parser.parse_args(argv)
    missing = missing_modules(read_list(args.list, args.tiny))
    if not missing:
        print("every module the check imports is here")
        return 0
    problem = install(missing, args.wheels, args.target)
    if problem is None:
        importlib.invalidate_caches()
        sys.path.insert(0, str(args.target.resolve()))
        still = missing_modules(missing)
        problem = f"installed into {args.target} but still not importable: {', '.join(m for m, _ in still)}" \
            if still else None
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    print(f"installed {', '.join(requirement for _, requirement in missing)} into {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
