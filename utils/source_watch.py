"""Whether the project's code on disk is still the code a process started with.

A checkout updated under a running training process (git pull, a branch switched) leaves it running the old
modules it imported, while anything it imports later would come from the new files: a newer module against
older ones is an ImportError or, worse, a silent mismatch. `SourceWatch` records every source file of the
project's packages when the process starts (size, mtime and a digest of its bytes) and names the files of the
modules the process has loaded that differ since (a change to a tool it never imports changes nothing it runs);
reading the sizes and mtimes again costs about a millisecond, and a digest is taken again only for a file whose
size or mtime moved (a file touched but not changed is not a change).
"""
from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def project_sources(root: Path = PROJECT_ROOT) -> list[Path]:
    """The Python files a training process may import: the top-level modules and every package's (a folder with an
    __init__.py) files. Other folders under the root (run folders, data, a virtual environment) are not walked."""
    files = sorted(root.glob("*.py"))
    for folder in sorted(root.iterdir()):
        if folder.is_dir() and not folder.name.startswith(".") and (folder / "__init__.py").is_file():
            files += sorted(folder.rglob("*.py"))
    return files


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_size, info.st_mtime_ns


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


class SourceWatch:
    """The project's sources as they are now; `changed()` names those that differ later (removed, added
    packages' files aside: a new file changes nothing that runs). `due()` paces the checks: at most one every
    `every` seconds."""

    def __init__(self, root: Path = PROJECT_ROOT, every: float = 1.0) -> None:
        self.root, self.every = root, every
        self._files = {path: (_stamp(path), _digest(path)) for path in project_sources(root)}
        self._checked = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self._checked >= self.every

    def changed(self) -> list[str]:
        """The files (relative to the root) of the modules loaded now whose bytes differ from the start's, or that
        are gone."""
        self._checked = time.monotonic()
        moved = [path for path, (stamp, _) in self._files.items() if _stamp(path) != stamp]
        if not moved:
            return []
        loaded = {Path(file).resolve() for module in list(sys.modules.values())
                  if isinstance(file := getattr(module, "__file__", None), str)}
        changed = []
        for path in moved:
            now, digest = _stamp(path), self._files[path][1]
            if now is not None and _digest(path) == digest:
                self._files[path] = (now, digest)  # touched, not changed
            elif path.resolve() in loaded:
                changed.append(str(path.relative_to(self.root)))
        return changed

    def describe(self, changed: list[str]) -> str:
        """`changed` in a few words, for a log line."""
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return f"{', '.join(changed[:3])}{more} in {self.root}"
