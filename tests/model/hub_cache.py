"""A Hugging Face hub cache laid out on disk by a test (no network): models--org--name with
refs/<branch> naming a commit and snapshots/<commit>/ holding the files, as huggingface_hub
writes it."""

from __future__ import annotations

import shutil
from pathlib import Path


def add_snapshot(cache: Path, repo_id: str, files_from: Path, commit: str, branch: str | None = "main") -> Path:
    """Copy the model files in `files_from` in as `repo_id` at `commit` (the ref `branch` points
    at it). -> the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(files_from, snapshot)
    if branch is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
    return snapshot
