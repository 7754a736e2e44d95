"""Walks plan nodes and applies their registry semantics (like a torch.fx Interpreter).

The same interpreter runs on numbers (NumericBackend) and on symbolic terms (SymbolicBackend):
only the arrays it is given differ.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from tvsmt.errors import InternalError, PlanError, StructuralViolation
from tvsmt.ops import AttrError, Backend, NodeCtx, ShapeRuleError
from tvsmt.ops import get as get_op
from tvsmt.ops.registry import attrs_key
from tvsmt.plan.model import Node, Plan

Shape = tuple[int, ...]


def internal_error(node: Node, e: BaseException) -> InternalError:
    """torch.fx style: say which node was being executed when the entry failed."""
    return InternalError(f"internal error while executing node {node.id} ({node.op}"
                         f"{'/' + node.pass_ if node.pass_ else ''}): {type(e).__name__}: {e} "
                         "(a bug in the operator's registry entry; please report it)",
                         node=node.id, op=node.op)


def _brief(attrs: dict, limit: int = 120) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in attrs.items())
    return "{" + (text if len(text) <= limit else text[:limit] + "...") + "}"


def _memo_key(node: Node, ins: list, shapes: dict, plan: Plan) -> tuple:
    """What a symbolic rule's result depends on, and nothing else: the operator and pass, the
    attributes its rules read (`OpSpec.semantic_attrs`, as the stage templates key them), the
    shapes in its `NodeCtx` (reduced outputs, original inputs and outputs) and the input terms.
    pysmt hash-conses terms in one environment, so equal ids mean equal terms, and a rule is a
    deterministic function of these: the same key gives the same output terms. So two nodes
    that compute the same thing on the same terms (a norm every tensor-parallel rank runs on
    its copy of the activation) are executed once."""
    reads = get_op(node.op).semantic_attrs
    return (node.op, node.pass_, attrs_key(node.attrs if reads is None else reads(node.attrs)),
            tuple(None if t is None else (shapes[t], plan.shape(t)) for t in node.outputs),
            tuple(None if t is None else plan.shape(t) for t in node.inputs),
            tuple(None if a is None else (a.shape, tuple(map(id, a.flat))) for a in ins))


class Interpreter:
    def __init__(self, plan: Plan, backend: Backend, shapes: dict[str, Shape] | None = None):
        self.plan = plan
        self.be = backend
        # Shapes the tensors have in this run (reduced); the plan's own shapes by default.
        self.shapes = shapes if shapes is not None else {t: i.shape for t, i in
                                                         plan.tensors.items()}

    def run_node(self, node: Node, env: dict[str, np.ndarray]) -> None:
        ins = [env[t] if t is not None else None for t in node.inputs]
        memo = getattr(self.be, "node_memo", None)
        key = None
        if memo is not None:
            key = _memo_key(node, ins, self.shapes, self.plan)
            hit = memo.get(key)
            if hit is not None:
                for t, value in zip(node.outputs, hit[1]):
                    if t is not None:
                        env[t] = value.copy()
                return
        spec = get_op(node.op)
        ctx = NodeCtx(tuple(self.shapes[t] if t is not None else None for t in node.outputs),
                      tuple(self.plan.shape(t) if t is not None else None for t in node.inputs),
                      tuple(self.plan.shape(t) if t is not None else None for t in node.outputs))
        rule = spec.backward if node.is_backward else spec.forward
        if rule is None:
            raise PlanError(f"operator {node.op} has no backward", file=self.plan.path,
                            node=node.id)
        try:
            outs = rule(self.be, ins, node.attrs, ctx)
        except (AttrError, ShapeRuleError) as e:
            # the entry refused this node's attributes/operands: a malformed plan
            raise PlanError(f"operator {node.op} cannot be applied with attrs "
                            f"{_brief(node.attrs)}: {e}", file=self.plan.path,
                            node=node.id) from None
        except KeyError as e:
            if e.args and isinstance(e.args[0], str) and e.args[0] not in node.attrs:
                raise PlanError(f"operator {node.op} needs attribute {e.args[0]!r} (attrs "
                                f"{_brief(node.attrs)})", file=self.plan.path,
                                node=node.id) from None
            raise internal_error(node, e) from e
        except (StructuralViolation, PlanError):
            raise
        except Exception as e:  # a bug in the operator's entry, not in the plan
            raise internal_error(node, e) from e
        if len(outs) != len(node.outputs):
            raise PlanError(f"operator {node.op} ({'backward' if node.is_backward else 'forward'})"
                            f" has {len(outs)} output slots, the node lists "
                            f"{len(node.outputs)}", file=self.plan.path, node=node.id)
        for t, value in zip(node.outputs, outs):
            if t is None:
                continue
            if value is None:
                raise StructuralViolation(f"node {node.id} ({node.op}) produces no value for "
                                          f"output {t}", node=node.id, tensor=t)
            value = np.asarray(value, dtype=object if self.be.symbolic else np.float64)
            if value.shape != tuple(self.shapes[t]):
                raise StructuralViolation(
                    f"node {node.id} ({node.op}) computes shape {list(value.shape)} for {t}, "
                    f"which has (reduced) shape {list(self.shapes[t])}", node=node.id, tensor=t)
            env[t] = value
        if key is not None:
            # the input terms are kept alive with the entry, so their ids stay theirs
            memo[key] = (ins, tuple(None if t is None else env[t].copy()
                                            for t in node.outputs))

    def run(self, node_indices: Iterable[int], env: dict[str, np.ndarray]) -> dict:
        for i in node_indices:
            self.run_node(self.plan.nodes[i], env)
        return env
