"""Phase 1: reading execplan v1 files into typed, validated dataclasses."""

from tvsmt.plan.model import Lineage, LineagePart, Node, Plan, TensorInfo
from tvsmt.plan.load import load_plan
from tvsmt.plan.reader import plan_from_dict, plan_from_object

__all__ = ["Plan", "Node", "TensorInfo", "Lineage", "LineagePart", "load_plan", "plan_from_dict",
           "plan_from_object"]
