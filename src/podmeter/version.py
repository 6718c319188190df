"""podmeter's version, and the commit it was built from when that is known (``podmeter --version``).

The commit comes from the file ``podmeter/COMMIT`` when an image build wrote one (the Dockerfile's
``PODMETER_COMMIT`` build argument), else, in a git checkout (an editable install), from git itself:
``HEAD``, with ``-dirty`` when tracked files differ from it. Anywhere else it is unknown and not shown.
"""

from __future__ import annotations

import functools
import importlib.metadata
import subprocess
from pathlib import Path

from podmeter import __version__

PACKAGE = Path(__file__).resolve().parent
COMMIT_FILE = PACKAGE / "COMMIT"


def version() -> str:
    """The installed distribution's version (the package's own when it is not installed)."""
    try:
        return importlib.metadata.version("podmeter")
    except importlib.metadata.PackageNotFoundError:
        return __version__


@functools.cache
def commit() -> str | None:
    """The commit podmeter was built from, or None when unknown."""
    try:
        baked = COMMIT_FILE.read_text().strip()
    except OSError:
        baked = ""
    return baked or _git_commit(PACKAGE.parent.parent)


def _git_commit(root: Path) -> str | None:
    if not (root / ".git").exists() or not (root / "pyproject.toml").is_file():
        return None  # not podmeter's own checkout (a site-packages inside some other repository)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=5,
                              check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if dirty else head or None


def describe() -> str:
    """``podmeter 0.1.0 (commit 0123456789ab)``, or without the commit when it is unknown."""
    known = commit()
    return f"podmeter {version()}" + (f" (commit {known})" if known else "")
