"""Every command line runs as a script too, as arcface_torch users spell it (`python tools/pack_rec.py`), through
the editable install of the project (pyproject.toml, the Makefile's setup step) rather than a sys.path edit;
and what `--help` says.

Each command runs in its own process, all started at once (an import of torch is seconds of CPU each).
`python -m tools.X` is the spelling every other test of a tool already runs (the same `__main__` block,
imported from the checkout), so here it is run for the demo only, whose `--help` used to start the demo.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tools").glob("*.py") if path.name != "__init__.py")
SCRIPTS += ["eval/verification.py", "eval/ijb.py", "eval/compare.py"]


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """`python <script> --help` of every script, and `python -m tools.demo --help`, by command."""
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    commands = {script: ([sys.executable, script, "--help"], ROOT) for script in SCRIPTS}
    commands["-m tools.demo"] = ([sys.executable, "-m", "tools.demo", "--help"], elsewhere)
    # Where the project's packages come from for a script: its own folder is first on sys.path, not the checkout.
    commands["install"] = ([sys.executable, "-c", "import dataset; print(dataset.__file__)"], elsewhere)
    started = {name: subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name, (command, cwd) in commands.items()}
    results = {}
    for name, process in started.items():
        out, err = process.communicate(timeout=300)
        results[name] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    return results


def test_the_project_is_installed_from_this_checkout(helps):
    found = helps["install"]
    assert found.returncode == 0 and Path(found.stdout.strip()) == ROOT / "dataset.py", (
        f"the venv's install of pairface does not point at {ROOT} ({found.stdout.strip() or found.stderr[-300:]}); "
        "run `make lint` (its setup step installs this checkout in editable mode)")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_tool_runs_as_a_script(helps, script):
    result = helps[script]
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"usage: {Path(script).name}") and not result.stderr


def test_the_demo_answers_help_without_starting(helps):
    result = helps["-m tools.demo"]
    assert result.returncode == 0 and result.stdout.startswith("usage: ") and "make demo" in result.stdout
    assert "demo: " not in result.stdout  # the demo's own progress lines: it did not start


def test_the_verification_options_say_what_they_do(helps):
    usage = " ".join(helps["eval/verification.py"].stdout.split())
    assert "--batch-size BATCH_SIZE images per forward pass (memory only" in usage
    assert "--nfolds NFOLDS cross-validation folds of the accuracy" in usage
    assert "--batch-size BATCH_SIZE images per forward pass" in " ".join(helps["eval/ijb.py"].stdout.split())
