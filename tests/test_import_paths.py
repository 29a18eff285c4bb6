"""One import path per face-data name: what dataset.py exports is imported from there by every file outside
facedata/ (code, benchmarks and tests), never from the facedata module that defines it, and facedata/ itself
exports nothing, so that a newcomer finds each name in one place.

Reference: the import statements themselves, read with ast (no module of the project is run but dataset.py,
whose __all__ is the list checked against)."""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import dataset
import facedata

ROOT = Path(__file__).resolve().parent.parent


def project_files() -> list[Path]:
    """The repository's Python files (git's list: not the virtual environments or the runs beside them)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / name for name in listed
            if Path(name).parts[0] != "facedata" and name != "dataset.py" and (ROOT / name).is_file()]


def test_names_dataset_exports_come_from_dataset_everywhere_outside_facedata():
    exported = set(dataset.__all__)
    found = []
    for path in project_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("facedata"):
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {alias.name} from {node.module}"
                          for alias in node.names if alias.name in exported]
    assert not found, "import these from dataset: " + "; ".join(found)


def test_every_exported_name_is_there_and_facedata_exports_nothing_itself():
    assert len(set(dataset.__all__)) == len(dataset.__all__)
    assert all(hasattr(dataset, name) for name in dataset.__all__)
    assert not hasattr(facedata, "__all__")
    assert not [name for name in vars(facedata) if not name.startswith("__")
                and not isinstance(getattr(facedata, name), type(facedata))]  # submodules once imported: fine
