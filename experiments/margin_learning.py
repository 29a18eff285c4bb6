"""Does each margin family learn? Held-out verification accuracy after the same short training, per family.

    python -m experiments.margin_learning [--epochs 2] [--seed 2048] [--families combined adaface ...]

One synthetic data set (300 training identities of 8 two-view records, 100 held-out identities, 200
pairs: tests/test_train_learning.py's) and configs/synthetic_pair.py as it is, but for its length (2
epochs, 150 steps) and `margin_family`: every family with its paper's keys (configs/base.py) at the
config's scale s = 32. Each run is train.py in its own process, one after another; the table gives each
family's final Accuracy-Flip on the held-out identities, its difference to the combined family's, and
its wall time relative to the combined family's run (all measured in this run).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from margin_families import FAMILIES
from tools import make_synthetic

ROOT = Path(__file__).resolve().parent.parent
FINAL = re.compile(r"training finished at global step (\d+): synthetic_val Accuracy-Flip ([\d.]+)")


def train(data: Path, output: Path, family: str, epochs: int, seed: int) -> tuple[float, float]:
    """(held-out Accuracy-Flip, seconds) of one run of configs/synthetic_pair.py with `family`."""
    command = [sys.executable, "train.py", "configs/synthetic_pair.py"]
    for item in (f"rec={data}", f"output={output}", f"num_epoch={epochs}", "verbose=100000", f"seed={seed}",
                 f"margin_family={family!r}"):
        command += ["--set", item]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"error: the {family} run failed:\n{result.stderr[-2000:]}")
    return float(FINAL.search((output / "training.log").read_text()).group(2)), seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=2048, help="training seed (the data is fixed)")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    args = parser.parse_args(argv)
    families = ["combined", *[family for family in args.families if family != "combined"]]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        make_synthetic.main(["--output", str(data), "--identities", "300", "--images-per-identity", "8",
                             "--val-identities", "100", "--val-pairs", "200", "--workers", "1"])
        results = {family: train(data, Path(tmp) / family, family, args.epochs, args.seed) for family in families}
    base_accuracy, base_seconds = results["combined"]
    print(f"{'family':<14}{'held-out accuracy':>19}{'vs combined':>13}{'time vs combined':>18}")
    for family, (accuracy, seconds) in results.items():
        print(f"{family:<14}{accuracy:>19.4f}{100 * (accuracy - base_accuracy):>+12.1f}p"
              f"{seconds / base_seconds:>17.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
