"""What only a GPU can show, in one run of under 8 minutes on one GPU, as one table (bench/gpu_check.sh).

Rows:
- check_pfc: tools/check_pfc.py through NCCL (world 1) on CUDA, float64 against the dense reference,
  all centres and 10% sampled: PASS/FAIL and the worst relative error.
- train 2 views / 1 view: train.py, r50, fp16, 128 records per step, 200 steps on JPEG records packed
  on the spot (decoded by the data workers): samples/s and images/s of the last log lines, peak GPU
  memory, final loss. The two rows' ratio is the cost of the second view.
- train 2 views, dali: the same with `dali=True` (nvJPEG decoding on the GPU).
- deterministic resume: a tiny network with `deterministic=True`, 3 + 3 steps against 6 uninterrupted
  ones, compared tensor for tensor: the README's promise of bitwise resume on GPUs.
- bench_pfc: PartialFC fp16 at 1M and 4M classes, sample rate 1.0 and 0.1: ms per step and peak
  memory as ratios to a dense nn.Linear + margin + cross-entropy where that fits.
- memory plan: the --dry-run memory plan of r50 and of vit_b (checkpointed) at 128 x 2 views in fp16
  against a real step (bench/step_memory.py): the total planned / the peak allocated, and plan/peak per item.
- gpu decode: GPU-decoded batches against CPU-decoded ones (tests/test_loader.py's GPU tests).

`--tiny` runs every row on the CPU with tiny shapes: a smoke test of this script, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.step_memory import ratios

ROOT = Path(__file__).resolve().parent.parent
SPEED = re.compile(r"Speed ([\d.]+) samples/sec ([\d.]+) images/sec   Loss ([\d.]+)")
PEAK = re.compile(r"peak GPU memory ([\d.]+) GiB")


def sh(command: list[str], timeout: float) -> tuple[int, str]:
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"
    return done.returncode, done.stdout + done.stderr


def check_pfc(tiny: bool) -> list[tuple[str, str]]:
    rows = []
    for rate in ("1.0", "0.1"):
        classes = "1001" if tiny else "100003"
        status, out = sh([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m",
                          "tools.check_pfc", "--views", "2", "--classes", classes, "--sample-rate", rate], 300)
        verdict = re.search(r"(PASS|FAIL): worst (\S+)", out)
        rows.append((f"check_pfc sample_rate {rate}", f"{verdict[1]} (worst relative error {verdict[2]})"
                     if verdict else f"did not run (exit {status}): {out.strip().splitlines()[-1:]}"))
    return rows


def make_data(folder: Path, views: int, tiny: bool) -> None:
    identities = "40" if tiny else "2000"
    status, out = sh([sys.executable, "-m", "tools.make_synthetic", "--output", str(folder), "--identities",
                      identities, "--images-per-identity", "8", "--views", str(views), "--val-identities", "10",
                      "--val-pairs", "20", "--overwrite"], 600)
    if status:
        raise RuntimeError(f"make_synthetic failed: {out[-2000:]}")


def train_row(name: str, data: Path, output: Path, tiny: bool, *extra: str) -> tuple[str, str]:
    network = (["network=r18", "network_kwargs={'width_mult': 0.125}", "embedding_size=64", "batch_size=4",
                "max_steps=6", "frequent=2", "num_workers=1", "fp16=False"] if tiny else
               ["network=r50", "network_kwargs={}", "embedding_size=512", "batch_size=128", "max_steps=200",
                "frequent=20", "num_workers=8", "fp16=True"])
    command = [sys.executable, "train.py", "configs/synthetic_pair.py"]
    for item in [f"rec={data}", f"output={output}", *network, "num_epoch=1000", "verbose=1000000",
                 "save_all_states=False", "val_targets=()", *extra]:
        command += ["--set", item]
    start = time.monotonic()
    status, out = sh(command, 400)
    if status:
        return name, f"FAILED (exit {status}): {out.strip().splitlines()[-1:]}"
    speeds = SPEED.findall(out)[-3:]  # the steady state: the first lines include start-up
    samples = sum(float(s[0]) for s in speeds) / len(speeds)
    images = sum(float(s[1]) for s in speeds) / len(speeds)
    peak = PEAK.search(out)
    return name, (f"{samples:.0f} samples/s, {images:.0f} images/s, peak {peak[1] if peak else '-'} GiB, "
                  f"final loss {speeds[-1][2]}, {time.monotonic() - start:.0f} s")


def deterministic_resume(data: Path, folder: Path) -> tuple[str, str]:
    script = ("import json\nfrom pathlib import Path\n"
              "from tests.run_helpers import assert_same_run, run_here\n"
              f"data, root = Path({str(data)!r}), Path({str(folder)!r})\n"
              "settings = ['deterministic=True', 'save_every_steps=1', 'num_epoch=100']\n"
              "assert run_here(data, root / 'whole', *settings, 'max_steps=6')[0] == 0\n"
              "assert run_here(data, root / 'split', *settings, 'max_steps=3')[0] == 0\n"
              "assert run_here(data, root / 'split', *settings, 'max_steps=6', resume=True)[0] == 0\n"
              "info = json.loads((root / 'whole' / 'model.json').read_text())\n"
              "assert_same_run(root / 'split', root / 'whole', info)\n"
              "print('bitwise equal')\n")
    status, out = sh([sys.executable, "-c", script], 300)
    return "deterministic resume (3+3 vs 6 steps)", ("bitwise equal" if status == 0 and "bitwise equal" in out
                                                     else f"DIFFERS or failed: {out.strip().splitlines()[-2:]}")


def bench_pfc(tiny: bool) -> list[tuple[str, str]]:
    classes = ["10000"] if tiny else ["1000000", "4000000"]
    device = [] if tiny else ["--device", "cuda", "--fp16"]
    status, out = sh([sys.executable, "-m", "bench.bench_pfc", "--classes", *classes, *device], 300)
    lines = [line for line in out.splitlines() if re.match(r"\s*\d+\s+(dense|pfc)", line)]
    if status or not lines:
        return [("bench_pfc", f"FAILED (exit {status}): {out.strip().splitlines()[-1:]}")]
    return [(f"bench_pfc {' '.join(line.split()[:2])}", " ".join(line.split()[2:])) for line in lines]


# bench.step_memory's configurations: the memory plan of each against a real step (one process).
MEMORY_PLAN_CASES = {
    "r50 fp16, 128 x 2 views, 1M classes at 10%": "network=r50 fp16=True batch_size=128 num_classes=1000000 "
                                                  "sample_rate=0.1",
    "vit_b fp16 (checkpointed), 128 x 2 views, 100k classes": "network=vit_b fp16=True batch_size=128 "
                                                              "num_classes=100000",
}
TINY_MEMORY_PLAN = ["network=r18", "network_kwargs={'width_mult':0.0625}", "batch_size=2", "num_classes=1000"]


def memory_plan(tiny: bool) -> list[tuple[str, str]]:
    """The --dry-run memory plan against what a real step allocates (bench/step_memory.py): the total and
    plan/peak per item, from the CUDA caching allocator's statistics."""
    command = [sys.executable, "-m", "bench.step_memory", "configs/synthetic_pair.py", "--json"]
    for item in ["rec=synthetic", "embedding_size=512", "num_workers=0", "optimizer=sgd", "network_kwargs={}",
                 *(TINY_MEMORY_PLAN if tiny else [])]:
        command += ["--set", item]
    for case in ([] if tiny else MEMORY_PLAN_CASES.values()):
        command += ["--case", case]
    status, out = sh(command + ([] if tiny else ["--device", "cuda"]), 400)
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if status or not results:
        return [("memory plan", f"FAILED (exit {status}): {out.strip().splitlines()[-1:]}")]
    names = ["tiny r18 on the CPU"] if tiny else list(MEMORY_PLAN_CASES)
    return [(f"memory plan {name}", ratios(result)) for name, result in zip(names, results, strict=True)]


def gpu_decode(tiny: bool) -> tuple[str, str]:
    if tiny:
        return "gpu decode vs cpu decode", "skipped (needs a GPU)"
    status, out = sh([sys.executable, "-m", "pytest", "-q", "tests/test_loader.py", "-k", "gpu", "-p",
                      "no:cacheprovider"], 300)
    return "gpu decode vs cpu decode", (out.strip().splitlines()[-1] if out.strip() else f"exit {status}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test of this script (tiny shapes)")
    args = parser.parse_args(argv)
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows += check_pfc(args.tiny)
        make_data(work / "pairs", 2, args.tiny)
        make_data(work / "single", 1, args.tiny)
        rows.append(train_row("train 2 views", work / "pairs", work / "two", args.tiny, "num_views=2"))
        rows.append(train_row("train 1 view", work / "single", work / "one", args.tiny, "num_views=1"))
        rows.append(train_row("train 2 views, dali=True", work / "pairs", work / "dali", args.tiny, "num_views=2",
                              "dali=True"))
        rows.append(deterministic_resume(work / "pairs", work / "resume"))
        rows += bench_pfc(args.tiny)
        rows += memory_plan(args.tiny)
        rows.append(gpu_decode(args.tiny))
    width = max(len(name) for name, _ in rows)
    print(f"{'check':<{width}}  result")
    for name, result in rows:
        print(f"{name:<{width}}  {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
