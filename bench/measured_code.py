"""Which code a benchmark measured, printed with its figures so they can be traced to a commit."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def code_version() -> str:
    """The commit measured, and the tracked files outside bench/, docs/ and README.md that differ from it."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench", ":!docs", ":!README.md"],
            capture_output=True, text=True, check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    changed = [line[3:] for line in changed if line.strip()]
    return f"{commit} + uncommitted changes to {', '.join(changed)}" if changed else commit
