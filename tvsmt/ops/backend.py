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
    return Fraction(str(c))


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
    "uf_div": lambda a, b: a / b if b != 0 else math.nan,
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


class SymbolicBackend(Backend):
    """pysmt terms in numpy object arrays; one instance per formula environment."""

    symbolic = True

    def __init__(self):
        from pysmt.shortcuts import get_env
        from pysmt.typing import REAL, FunctionType

        env = get_env()
        env.enable_infix_notation = True
        self.mgr = env.formula_manager
        self.real = REAL  # the pysmt sort of every tensor element
        self._uf_cache: dict[tuple[str, int], Any] = {}
        self._fn1 = FunctionType(REAL, [REAL])
        self._fn2 = FunctionType(REAL, [REAL, REAL])
        self._neg_inf = self.mgr.Symbol("neg_inf", REAL)

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
        f = self._uf("uf_div", 2)
        fn = np.frompyfunc(lambda a, b: self.mgr.Function(f, [a, b]), 2, 1)
        return np.asarray(fn(x, y), dtype=object)

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

    def maximum(self, x, y):
        fn = np.frompyfunc(lambda a, b: self.mgr.Ite(
            self.mgr.LE(self._term(b), self._term(a)), self._term(a), self._term(b)), 2, 1)
        return np.asarray(fn(x, y), dtype=object)

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
