"""`make mutants`: mutation testing of the core modules with mutmut, one table row per module.

    make mutants                                          # the default modules below
    make mutants MODULES="partial_fc.py losses.py"        # some of them
    make mutants MODULES="training/memory_plan.py:_softmax_peaks"   # one module-level function's mutants
    make mutants MODULES="losses.py:AdaFaceMargin"        # one class's (its methods')

mutmut (configured in pyproject.toml) copies the code into mutants/, plants every mutant behind a switch
and runs, for each mutant, the tests that executed the mutated function in a first, recorded pass.
Code that runs only in processes a test spawns (the gloo ranks of tests/distributed_helpers.run_world)
is invisible to that record, so every mutant mutmut reports as survived or untested is run once more
against the module's whole test files (`TEST_FILES`), spawned ranks included: those it kills there
count as killed. Whatever survives both is listed with its diff; docs/testing.md says why each of the
known survivors is equivalent or not worth a test.
"""
from __future__ import annotations

import ast
import functools
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Each module with the test files that cover it (the mutmut selection in pyproject.toml is their union).
TEST_FILES = {
    "partial_fc.py": ["tests/test_partial_fc.py", "tests/test_check_pfc.py"],
    "losses.py": ["tests/test_losses.py", "tests/test_margin_families.py", "tests/test_partial_fc.py"],
    "utils/lr_scheduler.py": ["tests/test_lr_scheduler.py"],
    "facedata/recordio.py": ["tests/test_recordio.py"],
    "facedata/loader.py": ["tests/test_loader.py"],
    "checkpoint/checkpointer.py": ["tests/test_checkpointer.py"],
    "checkpoint/safe_dcp.py": ["tests/test_safe_dcp.py", "tests/test_sharded.py"],
    "checkpoint/manifest.py": ["tests/test_manifest.py", "tests/test_sharded.py"],
    # test_sharded.py's saves reach checkpoint.json too, at minutes per mutant: its four hundred mutants (mostly
    # its messages' words) are run against the checks of the file itself.
    "checkpoint/pointer.py": ["tests/test_pointer.py"],
    "training/memory_plan.py": ["tests/test_memory_plan.py"],
}
DEFAULT = list(TEST_FILES)
RECHECK_TIMEOUT = 300  # seconds; a mutant that desynchronises two ranks' collectives would wait far longer


@functools.cache
def mutant_prefix(target: str) -> str:
    """The start of mutmut's names for the mutants of `target`: a module, `module:function` or `module:Class`
    (mutmut names a method's mutants `xǁClassǁmethod__mutmut_<n>`, a function's `x_function__mutmut_<n>`)."""
    module, _, name = target.partition(":")
    prefix = module.removesuffix(".py").replace("/", ".") + "."
    if not name:
        return prefix
    classes = {node.name for node in ast.parse((ROOT / module).read_text()).body if isinstance(node, ast.ClassDef)}
    return prefix + (f"xǁ{name}ǁ" if name in classes else f"x_{name}__mutmut_")


def mutmut(*args: str, capture: bool = False) -> str:
    result = subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE if capture else subprocess.DEVNULL, check=False)
    return result.stdout or ""


def statuses(modules: list[str]) -> dict[str, str]:
    """mutant name -> mutmut's verdict, for the mutants of these modules."""
    found = {}
    for line in mutmut("results", "--all", "true", capture=True).splitlines():
        match = re.fullmatch(r"\s*(\S+): (.+)", line)
        if match and any(match[1].startswith(mutant_prefix(m)) for m in modules):
            found[match[1]] = match[2].strip()
    return found


def killed_by_whole_files(name: str, module: str) -> bool:
    """Run the module's test files against one mutant, spawned processes included (they inherit the switch)."""
    env = {**os.environ, "MUTANT_UNDER_TEST": name, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
               *TEST_FILES[module.partition(":")[0]]]
    try:
        result = subprocess.run(command, cwd=ROOT / "mutants", env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, timeout=RECHECK_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        return True
    return result.returncode != 0


def diff(name: str) -> str:
    lines = mutmut("show", name, capture=True).splitlines()
    return " | ".join(line[1:].strip() for line in lines if line[:1] in "+-" and line[:3] not in ("+++", "---"))


def main(argv: list[str]) -> int:
    modules = argv or DEFAULT
    unknown = [m for m in modules if m.partition(":")[0] not in TEST_FILES]
    if unknown:
        print(f"no mutation setup for {unknown}; choose among {list(TEST_FILES)}", file=sys.stderr)
        return 2
    shutil.rmtree(ROOT / "mutants", ignore_errors=True)  # stale mutants or test records would skew the counts
    # mutmut's first pass runs its whole test selection (pyproject.toml: every module's files); the files of the
    # modules not chosen are deselected, so that a run costs what its modules' tests cost.
    chosen = {path for module in modules for path in TEST_FILES[module.partition(":")[0]]}
    others = sorted({path for paths in TEST_FILES.values() for path in paths} - chosen)
    os.environ["PYTEST_ADDOPTS"] = " ".join([os.environ.get("PYTEST_ADDOPTS", ""),
                                             *(f"--deselect {path}" for path in others)]).strip()
    mutmut("run", *(mutant_prefix(m) + "*" for m in modules), "--max-children", str(os.cpu_count() or 2))
    verdicts = statuses(modules)
    rows, survivors = [], []
    for module in modules:
        mine = {name: status for name, status in verdicts.items() if name.startswith(mutant_prefix(module))}
        counts = Counter(mine.values())
        rechecked = [name for name, status in mine.items() if status in ("survived", "no tests")]
        with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
            verdict = dict(zip(rechecked, pool.map(killed_by_whole_files, rechecked, [module] * len(rechecked))))
        late_kills = [name for name in rechecked if verdict[name]]
        left = [name for name in rechecked if name not in late_kills]
        survivors += [(name, diff(name)) for name in left]
        killed = counts["killed"] + counts["timeout"] + len(late_kills)
        other = len(mine) - killed - len(left)
        rows.append((module, len(mine), killed, len(left), counts["timeout"], len(late_kills), other))
    header = ("module", "mutants", "killed", "survived", "timeout", "killed by spawned ranks", "other")
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)))
    if survivors:
        print("\nsurvivors (docs/testing.md says why each known one is left):")
        for name, change in survivors:
            print(f"  {name}: {change}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
