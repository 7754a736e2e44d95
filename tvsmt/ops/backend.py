"""The arithmetic that operator semantics are written against.

Every operator's forward and backward rule is ONE function over numpy arrays, written with
ordinary numpy code (`x @ w.T`, `np.sum`, `a * b`) plus the few calls of `Backend` below for
everything that is not a ring operation (constants, exp, rsqrt, division by a tensor, ...).
The same function then runs on:

* `NumericBackend`: float64 arrays, used by the tests against torch autograd and to confirm
  counterexamples with the real functions;
* `SymbolicBackend`: object arrays of pysmt terms, used to build the SMT obligations. Non-
  polynomial functions become uninterpreted functions (`uf_exp`, `uf_rsqrt`, ...), so the
  encoding stays in QF_UFNRA and portable; constants are exact rationals.

Abstracting a function as uninterpreted is sound for proofs: an equality that holds for every
interpretation of `uf_exp` holds in particular for the real exp.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np


def exact(c: Any) -> Fraction:
    """A plan constant as an exact rational: `1e-05` is 1/100000, not its binary double."""
    if isinstance(c, bool):
        return Fraction(int(c))
    if isinstance(c, (int, Fraction)):
        return Fraction(c)
    if isinstance(c, float):
        if not math.isfinite(c):
            raise ValueError(f"non-finite constant {c!r}")
        return Fraction(repr(c))
    try:
        return Fraction(str(c))
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"not a number: {str(c)[:40]!r}") from None


def _exp(a):
    return math.exp(a) if a < 700 else math.inf


def _sigmoid(a):
    return 1.0 / (1.0 + math.exp(-a)) if a > -700 else 0.0


def _gelu_tanh(a):
    """torch's gelu(approximate="tanh") and its derivative."""
    k = math.sqrt(2.0 / math.pi)
    inner = k * (a + 0.044715 * a ** 3)
    t = math.tanh(inner)
    grad = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * a * a)
    return 0.5 * a * (1.0 + t), grad


# Every uninterpreted function of the symbolic backend, with the real function it stands for
# (used to confirm a counterexample and to evaluate stages with the real functions).
UNINTERPRETED: dict[str, Any] = {
    "uf_exp": _exp,
    "uf_rsqrt": lambda a: 1.0 / math.sqrt(a) if a > 0 else math.nan,
    "uf_sigmoid": _sigmoid,
    "uf_cos": math.cos,
    "uf_sin": math.sin,
    "uf_recip": lambda a: 1.0 / a if a != 0 else math.nan,
    "uf_pow": lambda a, b: a ** b if a > 0 else math.nan,
    "uf_log": lambda a: math.log(a) if a > 0 else math.nan,
    "uf_sqrt": lambda a: math.sqrt(a) if a >= 0 else math.nan,
    "uf_tanh": math.tanh,
    "uf_erf": math.erf,
    "uf_gelu": lambda a: 0.5 * a * (1.0 + math.erf(a / math.sqrt(2.0))),
    "uf_gelu_grad": lambda a: (0.5 * (1.0 + math.erf(a / math.sqrt(2.0)))
                               + a * math.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi)),
    "uf_gelu_tanh": lambda a: _gelu_tanh(a)[0],
    "uf_gelu_tanh_grad": lambda a: _gelu_tanh(a)[1],
}


def route_topk(scores: np.ndarray, k: int, n_groups: int, topk_groups: int) -> np.ndarray:
    """The real MoE router selection (DeepSeek-V3 `Gate`, no bias): for each row of `scores`
    (T, E), the indices (T, k) of the k best experts in descending order, after group
    limiting: the E experts form `n_groups` contiguous blocks, a block scores its maximum, and
    only the experts of the best `topk_groups` blocks may be chosen. Ties go to the lower
    index (torch leaves them unspecified)."""
    scores = np.asarray(scores, dtype=np.float64)
    t, e = scores.shape
    sel = scores.copy()
    if n_groups > 1:
        if e % n_groups:
            raise ValueError(f"router: {e} experts do not form {n_groups} groups")
        block = sel.reshape(t, n_groups, e // n_groups).max(axis=-1)
        best = np.argsort(-block, axis=-1, kind="stable")[:, :topk_groups]
        keep = np.zeros((t, n_groups), dtype=bool)
        np.put_along_axis(keep, best, True, axis=-1)
        sel = np.where(np.repeat(keep, e // n_groups, axis=-1), sel, -np.inf)
    return np.argsort(-sel, axis=-1, kind="stable")[:, :k]


def _topk_index(j, k, n_groups, topk_groups, *scores) -> float:
    """Real function of the router's selection UF: index j of route_topk on one score row."""
    row = np.asarray(scores, dtype=np.float64)[None]
    return float(route_topk(row, int(k), int(n_groups), int(topk_groups))[0, int(j)])


# The selection of `route_topk` as an uninterpreted function of the WHOLE score row: one
# function per row length E (a pysmt function has one arity), arguments (j, k, n_groups,
# topk_groups, s_0, ..., s_{E-1}). Congruence is all a proof may use: equal rows give equal
# selections, whatever the function is.
MAX_ROUTED_EXPERTS = 1024
TOPK_UFS: tuple[str, ...] = tuple(f"uf_topk{e}" for e in range(1, MAX_ROUTED_EXPERTS + 1))
for _name in TOPK_UFS:
    UNINTERPRETED[_name] = _topk_index


class Backend:
    """Interface; see the two implementations below."""

    symbolic: bool = False

    def const(self, c: Any) -> Any:  # a scalar element
        raise NotImplementedError

    def full(self, shape, c: Any) -> np.ndarray:
        out = np.empty(tuple(shape), dtype=object if self.symbolic else np.float64)
        out.fill(self.const(c))
        return out

    def zeros(self, shape) -> np.ndarray:
        return self.full(shape, 0)

    def scale(self, x: np.ndarray, c: Any) -> np.ndarray:
        """x times an exact constant."""
        return x * self.const(c)

    def ipow(self, x: np.ndarray, n: int) -> np.ndarray:
        """x ** n for an integer n >= 0 as repeated multiplication (no `pow` in SMT-LIB)."""
        if n < 0:
            raise ValueError("negative integer power: use powc")
        out = self.full(np.shape(x), 1)
        for _ in range(n):
            out = out * x
        return out

    # Elementwise non-polynomial functions.
    def exp(self, x): raise NotImplementedError
    def rsqrt(self, x): raise NotImplementedError
    def sigmoid(self, x): raise NotImplementedError
    def cos(self, x): raise NotImplementedError
    def sin(self, x): raise NotImplementedError
    def powc(self, x, p): raise NotImplementedError  # x ** p for a non-integer constant p
    def div(self, x, y): raise NotImplementedError  # x / y, y a tensor
    def neg_inf(self): raise NotImplementedError  # -inf, as in an attention mask
    def select_eq(self, idx, k: int, then, other): raise NotImplementedError  # idx == k ? then : other

    # Added for the ATen entries (exact, no abstraction unless named uf_*).
    def log(self, x): raise NotImplementedError
    def sqrt(self, x): raise NotImplementedError
    def tanh(self, x): raise NotImplementedError
    def apply_uf(self, name: str, x): raise NotImplementedError  # a unary UNINTERPRETED entry
    def apply_uf2(self, name: str, x, y): raise NotImplementedError  # a binary one, broadcast
    def compare(self, x, y, op: str): raise NotImplementedError  # 1 where `x op y`, else 0
    def where(self, cond, a, b): raise NotImplementedError  # cond != 0 ? a : b
    def maximum(self, x, y): raise NotImplementedError  # x >= y ? x : y (exact, via ite)

    def constant_ints(self, x) -> np.ndarray | None:
        """x as an int array when every element is a known integer constant, else None."""
        raise NotImplementedError

    def topk_route(self, scores, k: int, n_groups: int, topk_groups: int):
        """(T, k) expert indices chosen from the (T, E) score rows (see route_topk)."""
        raise NotImplementedError


_COMPARE = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
            "eq": np.equal, "ne": np.not_equal}


class NumericBackend(Backend):
    symbolic = False

    def const(self, c):
        return float(c)

    def exp(self, x):
        return np.exp(x)

    def rsqrt(self, x):
        return 1.0 / np.sqrt(x)

    def sigmoid(self, x):
        return 1.0 / (1.0 + np.exp(-x))

    def cos(self, x):
        return np.cos(x)

    def sin(self, x):
        return np.sin(x)

    def powc(self, x, p):
        return np.power(x, float(p))

    def div(self, x, y):
        return np.asarray(x, dtype=np.float64) / y

    def neg_inf(self):
        return -np.inf

    def select_eq(self, idx, k, then, other):
        return np.where(np.asarray(idx) == k, then, other)

    def log(self, x):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log(x)

    def sqrt(self, x):
        return np.sqrt(x)

    def tanh(self, x):
        return np.tanh(x)

    def apply_uf(self, name, x):
        return np.vectorize(UNINTERPRETED[name], otypes=[np.float64])(x)

    def apply_uf2(self, name, x, y):
        return np.vectorize(UNINTERPRETED[name], otypes=[np.float64])(x, y)

    def compare(self, x, y, op):
        return _COMPARE[op](x, y).astype(np.float64)

    def where(self, cond, a, b):
        return np.where(np.asarray(cond) != 0, a, b)

    def maximum(self, x, y):
        return np.where(np.asarray(x) >= y, x, y)

    def constant_ints(self, x):
        x = np.asarray(x, dtype=np.float64)
        if not np.all(np.isfinite(x)) or not np.all(x == np.round(x)):
            return None
        return x.astype(np.int64)

    def topk_route(self, scores, k, n_groups, topk_groups):
        return route_topk(scores, k, n_groups, topk_groups).astype(np.float64)


def _direct_infix() -> None:
    """Make `a + b`, `a - b`, `a * b` of two pysmt terms call the formula manager directly.

    numpy builds every symbolic sum and product through these operators, and pysmt's own
    ones check the infix mode, look up the manager twice and type both sides on every call:
    without them the encoding is 17-27% cheaper (scripts/bench_infix.py). The term is the same
    hash-consed node (`Plus`, `Minus`, `Times` of the current environment, which is what
    pysmt calls for real and integer terms); anything else (a number on either side, bit
    vectors) takes pysmt's own path."""
    from pysmt.fnode import FNode, _mgr

    if getattr(FNode, "_tvsmt_direct_infix", False):
        return
    add, sub, mul = FNode.__add__, FNode.__sub__, FNode.__mul__

    def plus(self, right):
        if type(right) is FNode and not self.get_type().is_bv_type():
            return _mgr().Plus(self, right)
        return add(self, right)

    def minus(self, right):
        if type(right) is FNode and not self.get_type().is_bv_type():
            return _mgr().Minus(self, right)
        return sub(self, right)

    def times(self, right):
        if type(right) is FNode and not self.get_type().is_bv_type():
            return _mgr().Times(self, right)
        return mul(self, right)

    FNode._tvsmt_pysmt_infix = (add, sub, mul)  # kept for tests and scripts/bench_infix.py
    FNode.__add__, FNode.__sub__, FNode.__mul__ = plus, minus, times
    FNode._tvsmt_direct_infix = True


def _post_order(root, done: dict, children):
    """The terms below `root` (itself included) that are not in `done`, each once, children
    before parents: the caller records each in `done` before asking for the next. A loop
    with a stack, as pysmt's walkers: terms are DAGs thousands of levels deep."""
    stack = [root]
    while stack:
        node = stack[-1]
        if node in done:
            stack.pop()
            continue
        todo = [c for c in children(node) if c not in done]
        if todo:
            stack.extend(todo)
            continue
        stack.pop()
        yield node


class SymbolicBackend(Backend):
    """pysmt terms in numpy object arrays, in an explicit pysmt `Environment` of their own.

    numpy code builds terms with infix operators, which pysmt resolves through its *current*
    environment: run the rules inside `with backend.active():`. `SymbolicBackend.fresh()`
    (what the pipeline uses) has an environment of its own, so its terms live as long as the
    backend and the formulas that hold them, not for the life of the process; a plain
    `SymbolicBackend()` shares pysmt's current environment (convenient in tests)."""

    symbolic = True

    @classmethod
    def fresh(cls) -> "SymbolicBackend":
        from pysmt.environment import Environment

        return cls(Environment())

    def __init__(self, env=None):
        from pysmt.environment import get_env
        from pysmt.typing import REAL, FunctionType

        self.env = env = env if env is not None else get_env()
        env.enable_infix_notation = True
        _direct_infix()
        self.mgr = env.formula_manager
        self.real = REAL  # the pysmt sort of every tensor element
        self._uf_cache: dict[tuple[str, int], Any] = {}
        self._fn1 = FunctionType(REAL, [REAL])
        self._fn2 = FunctionType(REAL, [REAL, REAL])
        self._neg_inf = self.mgr.Symbol("neg_inf", REAL)
        # node results by (node, input terms), see encoding/interpreter.py: a stage per
        # output of a multi-output node (an expert GEMM's backward has five) re-executes the
        # same nodes on the same terms; the memo lives as long as the terms' environment
        self.node_memo: dict = {}
        self._order_keys: dict = {}  # term -> _order_key(term), creation-order free
        self._signs: dict = {}  # term -> _nonnegative(term)

    def active(self):
        """Make this backend's environment pysmt's current one (a context manager)."""
        from contextlib import contextmanager

        from pysmt.environment import pop_env, push_env

        @contextmanager
        def scope():
            push_env(self.env)
            try:
                yield self
            finally:
                pop_env()

        return scope()

    def _uf(self, name: str, arity: int):
        if name not in UNINTERPRETED:
            raise AssertionError(f"{name} has no real function in backend.UNINTERPRETED")
        key = (name, arity)
        if key not in self._uf_cache:
            self._uf_cache[key] = self.mgr.Symbol(name, self._fn1 if arity == 1 else self._fn2)
        return self._uf_cache[key]

    def const(self, c):
        return self.mgr.Real(exact(c))

    def _map1(self, name, x):
        f = self._uf(name, 1)
        fn = np.frompyfunc(lambda a: self.mgr.Function(f, [a]), 1, 1)
        return np.asarray(fn(x), dtype=object)

    def exp(self, x):
        return self._map1("uf_exp", x)

    def rsqrt(self, x):
        return self._map1("uf_rsqrt", x)

    def sigmoid(self, x):
        return self._map1("uf_sigmoid", x)

    def cos(self, x):
        return self._map1("uf_cos", x)

    def sin(self, x):
        return self._map1("uf_sin", x)

    def powc(self, x, p):
        f = self._uf("uf_pow", 2)
        pc = self.const(p)
        fn = np.frompyfunc(lambda a: self.mgr.Function(f, [a, pc]), 1, 1)
        return np.asarray(fn(x), dtype=object)

    def div(self, x, y):
        """x times the uninterpreted reciprocal of y: linear in x as real division is (a sum
        divided by a count is its pieces divided by it), and sound wherever y is not zero,
        since 1/y is one interpretation of uf_recip."""
        return np.asarray(x, dtype=object) * self._map1("uf_recip", y)

    def neg_inf(self):
        return self._neg_inf

    def select_eq(self, idx, k, then, other):
        kc = self.const(k)
        fn = np.frompyfunc(lambda i, a, b: self.mgr.Ite(self.mgr.Equals(i, kc), a, b), 3, 1)
        return np.asarray(fn(idx, then, other), dtype=object)

    def log(self, x):
        return self._map1("uf_log", x)

    def sqrt(self, x):
        return self._map1("uf_sqrt", x)

    def tanh(self, x):
        return self._map1("uf_tanh", x)

    def apply_uf(self, name, x):
        return self._map1(name, x)

    def apply_uf2(self, name, x, y):
        f = self._uf(name, 2)
        fn = np.frompyfunc(lambda a, b: self.mgr.Function(f, [self._term(a), self._term(b)]), 2, 1)
        return np.asarray(fn(x, y), dtype=object)

    def _predicate(self, a, b, op):
        m = self.mgr
        if op == "lt":
            return m.LT(a, b)
        if op == "le":
            return m.LE(a, b)
        if op == "gt":
            return m.LT(b, a)
        if op == "ge":
            return m.LE(b, a)
        if op == "eq":
            return m.Equals(a, b)
        if op == "ne":
            return m.Not(m.Equals(a, b))
        raise ValueError(f"unknown comparison {op!r}")

    def _term(self, v):
        return v if hasattr(v, "node_type") else self.const(v)

    def compare(self, x, y, op):
        one, zero = self.const(1), self.const(0)
        fn = np.frompyfunc(lambda a, b: self.mgr.Ite(
            self._predicate(self._term(a), self._term(b), op), one, zero), 2, 1)
        return np.asarray(fn(x, y), dtype=object)

    def _truth(self, c):
        """The predicate `c != 0`, read straight off a 0/1 indicator ite(p, 1, 0)."""
        m = self.mgr
        c = self._term(c)
        if c.is_ite():
            p, a, b = c.args()
            if (a.is_constant() and b.is_constant() and a.constant_value() == 1
                    and b.constant_value() == 0):
                return p
        if c.is_constant():
            return m.Bool(c.constant_value() != 0)
        return m.Not(m.Equals(c, self.const(0)))

    def where(self, cond, a, b):
        fn = np.frompyfunc(lambda c, u, v: self.mgr.Ite(
            self._truth(c), self._term(u), self._term(v)), 3, 1)
        return np.asarray(fn(cond, a, b), dtype=object)

    def ipow(self, x, n):
        """x ** n; the square of `uf_sqrt(t)` is `t` itself where t is >= 0 by its form (a
        sum of squares: the real sqrt(t) ** 2 is t exactly). A norm of norms, as clipping by
        the global norm takes it over per-parameter norms (torch) or over shards' norms
        (DTensor, FSDP2), is then the square root of one sum of squares, as the single
        side's is. Any other t (possibly negative: torch gives NaN) keeps the square of the
        abstraction."""
        out = np.asarray(super().ipow(x, n), dtype=object)
        if n != 2:
            return out
        for at, e in np.ndenumerate(np.asarray(x, dtype=object)):
            t = self._term(e)
            if t.is_function_application() and t.function_name().symbol_name() == "uf_sqrt" \
                    and self._nonnegative(t.arg(0)):
                out[at] = t.arg(0)
        return out

    def _nonnegative(self, term) -> bool:
        """Is `term` >= 0 by its form alone: a nonnegative constant, a product whose factors
        (nested products flattened: ipow builds `(1 * x) * x`) pair up or are nonnegative, a
        sum or an ite of nonnegative terms."""
        known = self._signs

        def parts(node) -> list:
            if node.is_times():
                out, todo = [], list(node.args())
                while todo:
                    c = todo.pop()
                    if c.is_times():
                        todo.extend(c.args())
                    else:
                        out.append(c)
                return out
            if node.is_ite():
                return list(node.args()[1:])
            return list(node.args()) if node.is_plus() else []

        for node in _post_order(term, known, parts):
            if node.is_constant():
                known[node] = node.constant_value() >= 0
            elif node.is_times():
                odd: dict = {}
                for c in parts(node):
                    odd[c] = not odd.get(c, False)
                known[node] = all(known[c] for c, o in odd.items() if o)
            elif node.is_plus() or node.is_ite():
                known[node] = all(known[c] for c in parts(node))
            else:
                known[node] = False
        return known[term]

    def maximum(self, x, y):
        return np.asarray(np.frompyfunc(self._max_term, 2, 1)(x, y), dtype=object)

    def _max_term(self, a, b):
        """max(a, b) as `ite(b <= a, a, b)`, its operands in a canonical order. max is
        symmetric, but the ite is not: one side's `max(x, c)` and the other's `max(c, x)`
        (torch's clamp against DeepSpeed's clip of a norm) would be different terms, and
        the solver must case-split the whole polynomial below them to equate them."""
        a, b = self._term(a), self._term(b)
        if a is b:
            return a
        if b.is_constant() != a.is_constant():
            swap = a.is_constant()  # a constant goes second: relu and clamp as written
        else:
            swap = self._order_key(b) < self._order_key(a)
        if swap:
            a, b = b, a
        return self.mgr.Ite(self.mgr.LE(b, a), a, b)

    def _order_key(self, term) -> tuple[bytes, bytes]:
        """A total order on terms that does not depend on the order they were created in
        (pysmt's node ids do, and obligations must not: the node memo changes it): digests of
        the term's DAG, first without its symbols' names (stages equal up to their tensors'
        names keep one order, so their obligations stay byte-identical), then with them."""
        import hashlib

        keys = self._order_keys
        for node in _post_order(term, keys, lambda n: n.args()):
            if node.is_symbol():
                label, named = f"S{node.symbol_type()}", node.symbol_name()
            elif node.is_constant():
                label, named = f"C{node.constant_value()!r}", ""
            elif node.is_function_application():
                label, named = f"F{node.function_name().symbol_name()}", ""
            else:
                label, named = f"N{node.node_type()}", ""
            shape, full = hashlib.blake2b(label.encode(), digest_size=8), \
                hashlib.blake2b(f"{label}:{named}".encode(), digest_size=8)
            for c in node.args():
                shape.update(keys[c][0])
                full.update(keys[c][1])
            keys[node] = (shape.digest(), full.digest())
        return keys[term]

    def constant_ints(self, x):
        flat = np.asarray(x, dtype=object).ravel()
        out = np.empty(flat.shape, dtype=np.int64)
        for i, t in enumerate(flat):
            t = self._term(t)
            if not t.is_constant():
                return None
            v = Fraction(t.constant_value())
            if v.denominator != 1:
                return None
            out[i] = int(v)
        return out.reshape(np.shape(x))

    def topk_route(self, scores, k, n_groups, topk_groups):
        """Each index is `uf_topk<E>(j, k, n_groups, topk_groups, row...)` of its whole row:
        only congruence ties the two plans' selections together."""
        from pysmt.typing import FunctionType

        scores = np.asarray(scores, dtype=object)
        t, e = scores.shape
        name = f"uf_topk{e}"
        if name not in UNINTERPRETED:
            raise ValueError(f"router: {e} experts, more than the {MAX_ROUTED_EXPERTS} supported")
        key = (name, e + 4)
        if key not in self._uf_cache:
            self._uf_cache[key] = self.mgr.Symbol(
                name, FunctionType(self.real, [self.real] * (e + 4)))
        f = self._uf_cache[key]
        params = [self.const(k), self.const(n_groups), self.const(topk_groups)]
        out = np.empty((t, k), dtype=object)
        for r in range(t):
            row = list(scores[r])
            for j in range(k):
                out[r, j] = self.mgr.Function(f, [self.const(j)] + params + row)
        return out
