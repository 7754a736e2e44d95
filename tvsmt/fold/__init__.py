"""Replica folding: verify a few data-parallel replicas and micro-batches after checking that
all the others are exact copies of them (see folder.py for the method and why it is sound)."""

from tvsmt.fold.folder import Folded, Folder, FoldInfo, FoldRefused, UnitRecords
from tvsmt.fold.source import LoadedPlan, fold_plans, fold_source

__all__ = ["Folded", "FoldInfo", "Folder", "FoldRefused", "LoadedPlan", "UnitRecords",
           "fold_plans", "fold_source"]
