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


def folded_stages(folder: Path):
    """(single, parallel, stages) of a pair folder as `tvsmt verify` encodes it: loaded here,
    folded where it folds, its stages cut (for the scripts that time or digest the encoding)."""
    from tvsmt.fold import FoldRefused, fold_plans
    from tvsmt.graph import Graph
    from tvsmt.pipeline import PlanPair
    from tvsmt.stages.cutter import cut_stages

    pair = PlanPair.load(str(folder / "single.json.gz"), str(folder / "parallel.json.gz"))
    try:
        folded = fold_plans(pair.single, pair.parallel, 0)
        single, parallel = folded.single, folded.parallel
    except FoldRefused:
        single, parallel = pair.single, pair.parallel
    return single, parallel, cut_stages(single, parallel, Graph(single), Graph(parallel)).stages
