"""The device check (gpu_acceptance/gpu_check.sh) on this CPU: it starts from a bare python3 (the wheels it needs
installed from a folder, no registry), stops at once with the reason when torch, CUDA or a wheel is
missing, prints every row, and exits 1 naming the rows that failed or did not run. Cheap: no check runs
its real commands here (the whole `--tiny` rehearsal, every row for real, is the compatibility tier's).
"""
from __future__ import annotations

import base64
import hashlib
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from gpu_acceptance import gpu_check
from tests.run_helpers import ROOT

SCRIPT = ROOT / "gpu_acceptance" / "gpu_check.sh"


def run_script(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    environ = {key: value for key, value in os.environ.items() if key != gpu_check.PLANT}
    environ.update({"PY": sys.executable, "OMP_NUM_THREADS": "1", **env})
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=timeout)


def rows(out: str) -> dict[str, str]:
    """{row name: result} of the table the check printed."""
    found = {}
    for line in out.splitlines():
        match = re.match(rf"(.{{{gpu_check.NAME_WIDTH}}})  (.*)", line)
        if match and match[1].strip() != "check":
            found[match[1].strip()] = match[2]
    return found


def test_the_limits_nest_inside_eight_minutes():
    """The budgets fit in the check's own limit, which fits in the script's outer one, under 8 minutes."""
    net = int(re.search(r"^NET_SECONDS=(\d+)", SCRIPT.read_text(), re.MULTILINE)[1])
    tiny = int(re.search(r"^TINY_SLACK=(\d+)", SCRIPT.read_text(), re.MULTILINE)[1])
    assert sum(gpu_check.BUDGETS.values()) < gpu_check.default_limit(False) < net < 8 * 60
    # 430 s of rows: the rest of a session's 15 minutes on the GPU machine is its start and a rerun
    assert sum(gpu_check.BUDGETS.values()) <= gpu_check.ROWS_SECONDS == 430
    assert tiny == gpu_check.TINY_SLACK and gpu_check.default_limit(True) < net * tiny


def test_checks_the_limit_leaves_no_time_for_print_not_run_and_fail(capsys):
    assert gpu_check.main(["--tiny", "--limit", "0"]) == 1
    out = capsys.readouterr().out
    assert rows(out) == {check: "not run (time)" for check in gpu_check.BUDGETS}
    assert out.splitlines()[-1] == f"FAILED or not run: {'; '.join(gpu_check.BUDGETS)}"


def test_a_planted_failure_exits_1_and_names_its_row():
    """Two checks of --tiny, a failure planted in one: its row says why, the other row prints as it
    would, and the check says which row failed in its exit status and last line."""
    done = run_script("--tiny", "--only", "pfc precision", "gpu decode", **{gpu_check.PLANT: "pfc precision"})
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"Python {sys.version.split()[0]}, torch {torch.__version__}")
    assert lines[1] == "every module the check imports is here"
    table = rows(done.stdout)
    assert table["PartialFC vs float32"] == f"FAILED (exit 1): a failure planted by {gpu_check.PLANT}"
    assert table["gpu decode vs cpu decode"] == "skipped (needs a GPU)"
    assert table["train 2 views"] == "not run (not selected)"
    assert lines[-1] == "FAILED or not run: PartialFC vs float32"


def test_every_row_passing_is_exit_0(capsys):
    assert gpu_check.main(["--tiny", "--only", "gpu decode"]) == 0
    out = capsys.readouterr().out
    assert rows(out)["gpu decode vs cpu decode"] == "skipped (needs a GPU)"
    assert out.splitlines()[-1] == "every row passed"


def test_a_python_without_torch_stops_at_once_saying_so(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    done = run_script(PY=str(tmp_path / "bare" / "bin" / "python"), timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert re.fullmatch(r"gpu check: error: \S+ cannot import torch \(ModuleNotFoundError: No module named 'torch'\); "
                        r"run with PY=<a python that has torch>\n", done.stderr)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check runs instead of stopping")
def test_without_cuda_the_check_stops_before_any_row_saying_why():
    done = run_script(timeout=120)
    assert done.returncode == 2 and not rows(done.stdout)
    assert done.stderr.startswith("gpu check: error: CUDA cannot be used, so nothing here can be checked: ")
    assert done.stderr.count("\n") == 1


def make_wheel(folder: Path, name: str, version: str, source: str) -> Path:
    """A pure-Python wheel of module `name`, written as the wheel format says (no build tool needed)."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}.py": source,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: a test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


def run_wheels(tmp_path: Path, entries: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "list.txt").write_text(entries)
    return subprocess.run([sys.executable, "-m", "provision.gpu_wheels", "--list", str(tmp_path / "list.txt"),
                           "--wheels", str(tmp_path / "wheels"), "--target", str(tmp_path / "site"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_missing_module_is_installed_from_its_wheel_and_a_missing_wheel_is_named(tmp_path):
    (tmp_path / "wheels").mkdir()
    make_wheel(tmp_path / "wheels", "pairface_probe", "1.0", "ANSWER = 42\n")
    done = run_wheels(tmp_path, "# module requirement\npairface_probe  pairface-probe==1.0  # a test's\ntorch torch\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"installed pairface-probe==1.0 into {tmp_path / 'site'}\n"
    answer = subprocess.run([sys.executable, "-c", "import pairface_probe; print(pairface_probe.ANSWER)"],
                            env={**os.environ, "PYTHONPATH": str(tmp_path / "site")}, capture_output=True, text=True)
    assert answer.stdout == "42\n"
    done = run_wheels(tmp_path, "pairface_absent pairface-absent>=2\n")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == (f"error: this Python cannot import pairface_absent and {tmp_path / 'wheels'} has no wheel "
                           "of pairface-absent>=2 (for pairface_absent): run `bash provision/fetch_gpu_wheels.sh` on a "
                           f"machine with a package registry and bring {tmp_path / 'wheels'} along\n")
    done = run_wheels(tmp_path, "pairface_absent pairface-absent>=2 gpu  # only the GPU rows need it\n", "--tiny")
    assert (done.returncode, done.stdout) == (0, "every module the check imports is here\n")

