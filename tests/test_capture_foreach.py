"""torch's foreach kernels as the capture traces them (`tvsmt.capture.foreach`): each loop,
run on random tensors, leaves what torch's own foreach kernel leaves, in place or as the list
it returns; the overloads with a tensor of per-element scalars are refused in one line."""

from __future__ import annotations

import pytest
import torch

from tvsmt.capture.foreach import loop_decompositions

aten = torch.ops.aten


def _tensors(gen, n=3):
    return [torch.randn(2 + i, 3, generator=gen) for i in range(n)]


# (overload, arguments after the first list: "list" = another random list, else as given)
CALLS = [
    (aten._foreach_mul_.Tensor, [torch.tensor(0.3)], {}),
    (aten._foreach_mul_.Scalar, [0.7], {}),
    (aten._foreach_mul_.ScalarList, [[0.5, -1.5, 2.0]], {}),
    (aten._foreach_add_.List, ["list"], {"alpha": -0.1}),
    (aten._foreach_add.Scalar, [1.25], {}),
    (aten._foreach_sub_.List, ["list"], {"alpha": 3}),
    (aten._foreach_div_.List, ["list"], {}),
    (aten._foreach_lerp_.Scalar, ["list", 0.1], {}),
    (aten._foreach_lerp.List, ["list", "list"], {}),
    (aten._foreach_addcmul_.Scalar, ["list", "list", 0.01], {}),
    (aten._foreach_addcdiv_.ScalarList, ["list", "list", [0.1, 0.2, 0.3]], {}),
    (aten._foreach_addcdiv.Scalar, ["list", "list"], {"value": -2.0}),
    (aten._foreach_maximum_.List, ["list"], {}),
    (aten._foreach_clamp_max_.Scalar, [0.25], {}),
    (aten._foreach_pow.ScalarAndTensor, None, {}),
    (aten._foreach_pow.Scalar, [2.0], {}),
    (aten._foreach_sqrt, [], {}),
    (aten._foreach_exp_, [], {}),
    (aten._foreach_neg, [], {}),
    (aten._foreach_norm.Scalar, [2], {}),
    (aten._foreach_copy_, ["list"], {}),
    (aten._foreach_zero_, [], {}),
]


def _resolve(op):
    return op if isinstance(op, torch._ops.OpOverload) else op.default


@pytest.mark.parametrize("op, rest, kwargs", CALLS, ids=lambda c: str(c)[:40])
def test_each_loop_leaves_what_torch_s_foreach_kernel_leaves(op, rest, kwargs):
    op = _resolve(op)
    loop = loop_decompositions()[op]
    gen = torch.Generator().manual_seed(7)
    first = [t.abs() + 0.5 for t in _tensors(gen)]  # positive: sqrt, division and pow
    others = [[t.abs() + 0.5 for t in _tensors(gen)] for _ in range(3)]
    if rest is None:  # pow(Scalar self, Tensor[] exponent): the scalar comes first
        args = [1.5, first]
    else:
        lists = iter(others)
        args = [first] + [next(lists) if a == "list" else a for a in rest]

    def fresh(a):
        return [t.clone() for t in a] if isinstance(a, list) and a and \
            isinstance(a[0], torch.Tensor) else a

    theirs_args, ours_args = [fresh(a) for a in args], [fresh(a) for a in args]
    theirs = op(*theirs_args, **kwargs)
    ours = loop(*ours_args, **kwargs)
    if op._schema.name.endswith("_"):  # in place: the first list is the result
        assert ours is None
        theirs, ours = theirs_args[0], ours_args[0]
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (op, a, b)
    for a, b in zip(ours_args[1:], args[1:]):  # the other lists are left as they were
        if isinstance(b, list) and b and isinstance(b[0], torch.Tensor):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_every_foreach_op_of_torch_but_powsum_has_a_loop():
    ops = {str(op).split(".")[1] for op in loop_decompositions()}
    assert "_foreach_powsum" not in ops
    assert {"_foreach_mul_", "_foreach_add_", "_foreach_norm", "_foreach_lerp_",
            "_foreach_addcdiv_", "_foreach_sqrt", "_foreach_maximum_"} <= ops


def test_a_tensor_of_per_element_scalars_is_refused_in_one_line():
    op = aten._foreach_addcmul_.Tensor
    gen = torch.Generator().manual_seed(1)
    a, b, c = _tensors(gen), _tensors(gen), _tensors(gen)
    with pytest.raises(NotImplementedError, match=r"_foreach_addcmul_\.Tensor .*foreach=False"):
        loop_decompositions()[op](a, b, c, torch.ones(3))
