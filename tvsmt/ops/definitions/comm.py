"""Communication and gradient-finalization operators (pass: null).

A collective node on one rank lists the inputs of all group members (execplan v1 / OPS.md) and
writes that rank's output.
"""

from __future__ import annotations

from tvsmt.ops.registry import OpSpec, register


def _sum(ins):
    total = ins[0]
    for x in ins[1:]:
        total = total + x
    return total


def sum_fw(be, ins, attrs, ctx):
    return [_sum([x for x in ins if x is not None])]


def all_equal_shape(c, ins, outs, attrs):
    ref = next(t for t in ins if t is not None)
    for t in list(ins) + list(outs):
        if t is not None:
            c.same(t, ref)


register(OpSpec("all_reduce", sum_fw, all_equal_shape, communication=True,
                doc="sum of the group's inputs"))
