"""`make test-flaky`: the whole suite 3 times, each in another random order (pytest-randomly's seed) on two
pytest-xdist workers, then every test that failed in any run, with the seeds that replay it. Exit status 1
when one did. Not part of `make test` (three runs of the suite).

    make test-flaky                               # 3 runs, fresh seeds
    python -m dev.flaky --runs 5 tests/test_x.py  # other counts or files
"""
from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def failed_tests(junit_xml: Path) -> list[str]:
    """The tests a run reported failed or errored (in setup or teardown too), as module[.class]::name."""
    return [f"{case.get('classname')}::{case.get('name')}" for case in ElementTree.parse(junit_xml).iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None]


def run_once(seed: int, paths: list[str], workers: int, report: Path) -> int:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "randomly", f"--randomly-seed={seed}", "-n", str(workers),
               "--dist", "loadfile", "--no-loadscope-reorder", f"--junitxml={report}", *paths]
    print(f"run with seed {seed}: {' '.join(command[1:])}", flush=True)
    return subprocess.run(command, cwd=ROOT).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("paths", nargs="*", default=["tests"])
    args = parser.parse_args(argv)
    seeds = random.sample(range(1, 2 ** 31), args.runs)
    failures: dict[str, list[int]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            report = Path(tmp) / f"{seed}.xml"
            status = run_once(seed, args.paths, args.workers, report)
            if not report.exists():
                print(f"error: the run with seed {seed} ended with status {status} before writing its report")
                return 1
            for test in failed_tests(report):
                failures[test].append(seed)
    print(f"\n{len(seeds)} runs (seeds {', '.join(map(str, seeds))}): "
          f"{len(failures)} test(s) failed at least once")
    for test, failed_seeds in sorted(failures.items()):
        print(f"  {test}  failed with seed(s) {', '.join(map(str, failed_seeds))}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
