"""Where the scripts find a real plan pair: a folder, or the name of a pair of
../shared/plans (third-party data kept beside the checkout, never in it)."""

from __future__ import annotations

from pathlib import Path

SHARED_PLANS = Path(__file__).resolve().parents[2] / "shared" / "plans"


def plan_folder(name_or_folder: str) -> Path | None:
    """The pair's folder, or None (with the reason printed by the caller) when it holds no
    parallel.json.gz."""
    folder = Path(name_or_folder)
    if not folder.is_dir():
        folder = SHARED_PLANS / name_or_folder
    return folder if (folder / "parallel.json.gz").exists() else None
