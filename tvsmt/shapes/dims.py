"""Dimension variables and the divisor solver behind shape reduction.

Shape rules (in the operator registry) relate dimensions with products and equalities:
`a * m == b * n`, `prod(group) == prod(group)`, `d >= 2`. Here a dimension is a `Dim`; rules
combine them into `Mono`mials (coefficient times a product of dims), and `==`/`>=` build
constraint objects instead of booleans.

The solver works in *divisor space*. The original sizes N satisfy every rule (that is checked
per node beforehand). Choose for each dimension a divisor s of N and use the reduced size
N / s. A homogeneous rule `c1 * prod(a) == c2 * prod(b)` then holds after reduction exactly
when `prod(s_a) == prod(s_b)`. So every two-dim rule just says "same divisor" (a union-find
class), and a view's grouping says "the divisor of the merged dim is the product of the
divisors of its parts". Each class takes the largest divisor that keeps every member >= 2 and
every lineage boundary an integer; the product relations are solved by a small search with
propagation. Dividing everything by 1 (no reduction) always satisfies the rules, so a solution
always exists; this replaces an integer optimization problem by a few microseconds of work.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from math import gcd, isqrt, prod


class Dim:
    """One reduced dimension: original size `n`; `g` must be divisible by its divisor."""

    __slots__ = ("id", "n", "g", "_label", "_mono")

    def __init__(self, ident: int, n: int, label: "str | tuple[str, int]" = ""):
        self.id, self.n, self.g, self._label = ident, n, n, label
        self._mono = None

    @property
    def label(self) -> str:
        """The dimension's name; `(tensor, i)` is named `tensor[i]` only when asked (a
        stage's shape reduction makes hundreds of dims and names none of them)."""
        lab = self._label
        return lab if isinstance(lab, str) else f"{lab[0]}[{lab[1]}]"

    def mono(self) -> "Mono":
        m = self._mono  # immutable: made once (shape rules ask for it millions of times)
        if m is None:
            m = self._mono = Mono(_ONE, (self.id,))
        return m

    def __mul__(self, other):
        return self.mono() * other

    __rmul__ = __mul__

    def __eq__(self, other):  # builds a constraint, like a solver variable
        return Eq(self.mono(), as_mono(other))

    def __ge__(self, other):
        return Bound(self.id, other)

    def __hash__(self):
        return hash(self.id)

    def __repr__(self):
        return f"Dim({self.label or self.id}:{self.n})"


_ONE = Fraction(1)


class Mono:
    """coef * prod(dims); immutable (a plain slotted class: made in every shape rule)."""

    __slots__ = ("coef", "dims")

    def __init__(self, coef: Fraction, dims: tuple[int, ...]):
        self.coef = coef
        self.dims = dims  # dim ids, with multiplicity

    def __repr__(self):
        return f"Mono({self.coef}, {self.dims})"

    def __mul__(self, other):
        o = as_mono(other)
        a, b = self.coef, o.coef
        coef = b if a == 1 else a if b == 1 else a * b
        return Mono(coef, tuple(sorted(self.dims + o.dims)))

    __rmul__ = __mul__

    def __eq__(self, other):
        return Eq(self, as_mono(other))

    def __ge__(self, other):
        if len(self.dims) == 1 and self.coef == 1:
            return Bound(self.dims[0], other)
        raise TypeError("bounds are supported on single dimensions only")

    __hash__ = object.__hash__


def as_mono(x) -> Mono:
    if isinstance(x, Mono):
        return x
    if isinstance(x, Dim):
        return x.mono()
    if isinstance(x, int):
        return Mono(Fraction(x), ())
    raise TypeError(f"not a dimension expression: {x!r}")


@dataclass(frozen=True)
class Eq:
    lhs: Mono
    rhs: Mono


@dataclass(frozen=True)
class Bound:
    dim: int
    minimum: int


class DivisorSolver:
    def __init__(self):
        self.dims: list[Dim] = []
        self.parent: list[int] = []
        self.products: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self.fixed: dict[int, int] = {}  # dim id -> required divisor
        self.min_size: dict[int, int] = {}

    def new(self, n: int, label: "str | tuple[str, int]" = "") -> Dim:
        d = Dim(len(self.dims), n, label)
        self.dims.append(d)
        self.parent.append(d.id)
        return d

    def _find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def _union(self, i: int, j: int) -> None:
        a, b = self._find(i), self._find(j)
        if a != b:
            self.parent[a] = b

    def same(self, a: Dim, b: Dim) -> None:
        """`a == b` in divisor space: one class (what `add(a == b)` does, without the
        constraint object)."""
        self._union(a.id, b.id)

    def keep_divisible(self, dim: Dim, k: int) -> None:
        """The reduction must keep multiples of k/N... i.e. the divisor must divide k."""
        dim.g = gcd(dim.g, k)

    def add(self, c) -> None:
        if type(c) is Eq:
            lhs, rhs = c.lhs.dims, c.rhs.dims
            if len(lhs) == 1 and len(rhs) == 1:  # most rules: "same divisor", a union
                self._union(lhs[0], rhs[0])
                return
        if isinstance(c, bool):
            if not c:
                raise ValueError("impossible constraint")
            return
        if isinstance(c, Bound):
            self.min_size[c.dim] = max(self.min_size.get(c.dim, 1), int(c.minimum))
        elif isinstance(c, Eq):
            lhs, rhs = list(c.lhs.dims), list(c.rhs.dims)
            for d in list(lhs):  # cancel dims on both sides
                if d in rhs:
                    lhs.remove(d)
                    rhs.remove(d)
            if len(lhs) == 1 and len(rhs) == 1:
                self._union(lhs[0], rhs[0])
            elif not lhs and not rhs:
                return
            elif not lhs or not rhs:
                # dims == constant: the reduced size must equal the original (divisor 1)
                for d in lhs + rhs:
                    self.fixed[d] = 1
            else:
                self.products.append((tuple(lhs), tuple(rhs)))
        else:
            raise TypeError(f"unknown shape constraint {c!r}")

    def solve(self, budget: int = 200000) -> list[int]:
        """Reduced size of every dim (index = dim id)."""
        classes: dict[int, list[int]] = {}
        for d in self.dims:
            classes.setdefault(self._find(d.id), []).append(d.id)
        cand: dict[int, list[int]] = {}
        for root, members in classes.items():
            g = 0
            limit = None
            for m in members:
                dim = self.dims[m]
                g = gcd(g, dim.g)
                lo = max(self.min_size.get(m, 1), min(2, dim.n))
                cap = dim.n // lo  # divisor <= n / minimum size
                limit = cap if limit is None else min(limit, cap)
                if m in self.fixed:
                    limit = min(limit, self.fixed[m])
            divs = [k for k in _divisors(g) if k <= (limit or 1)]
            if any(m in self.fixed for m in members):
                divs = [k for k in divs if all(k == self.fixed[m] for m in members
                                               if m in self.fixed)] or [1]
            cand[root] = sorted(divs, reverse=True)
        prods = [(tuple(self._find(x) for x in l), tuple(self._find(x) for x in r))
                 for l, r in self.products]
        choice: dict[int, int] = {}
        involved = sorted({c for l, r in prods for c in l + r},
                          key=lambda c: (len(cand[c]), c))
        for root in cand:
            if root not in involved:
                choice[root] = cand[root][0]
        if involved and not _search(involved, cand, prods, choice, [budget]):
            for root in involved:  # no reduction for these (always consistent)
                choice[root] = 1
        return [d.n // choice[self._find(d.id)] for d in self.dims]


# Below TRIAL_DIVISION_BELOW, trial division up to the square root takes well under a
# millisecond. Up to FACTOR_BITS bits, sympy factors the dimension (trial division, Pollard
# rho, p-1) with a bounded effort; beyond (no real tensor is that large), only primes below
# SMALL_PRIMES_BELOW are divided out, each a few microseconds even at thousands of digits.
TRIAL_DIVISION_BELOW = 2**24
FACTOR_BITS = 128
FACTOR_EFFORT = 2**16  # sympy's `limit`; what stays unfactored is kept as one factor
SMALL_PRIMES_BELOW = 2**10
MAX_DIVISORS = 4096  # candidates per class; beyond, factors of the smallest primes are dropped


@lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    """Divisors of n, ascending (a subset when n is huge or has very many divisors).

    Any subset is sound: a divisor that is not offered only means a smaller reduction. So a
    hostile dimension (2**70, a product of two large primes, a primorial) costs a bounded
    factoring effort instead of a search up to its square root."""
    if n <= 0:
        return (1,)
    if n < TRIAL_DIVISION_BELOW:
        small = [k for k in range(1, isqrt(n) + 1) if n % k == 0]
        return tuple(sorted(set(small + [n // k for k in small])))
    factors = [[p, e] for p, e in sorted(_factor(n).items())]
    while prod(e + 1 for _, e in factors) > MAX_DIVISORS:
        smallest = next(f for f in factors if f[1] > 0)
        smallest[1] -= 1  # one factor of the smallest prime: the least reduction lost
    divs = [1]
    for p, e in factors:
        divs = [d * p**k for d in divs for k in range(e + 1)]
    return tuple(sorted(set(divs)))


def _factor(n: int) -> dict[int, int]:
    """{factor: exponent} whose product is n; factors are primes except perhaps one
    cofactor left unfactored (still a divisor of n, which is all `_divisors` needs)."""
    from sympy import factorint, primerange

    if n.bit_length() <= FACTOR_BITS:
        return factorint(n, limit=FACTOR_EFFORT)
    factors: dict[int, int] = {}
    for p in primerange(2, SMALL_PRIMES_BELOW):
        while n % p == 0:
            factors[p] = factors.get(p, 0) + 1
            n //= p
    if n > 1:
        factors[n] = factors.get(n, 0) + 1
    return factors


def _prod(xs, choice) -> int | None:
    p = 1
    for x in xs:
        if x not in choice:
            return None
        p *= choice[x]
    return p


def _search(order, cand, prods, choice, budget) -> bool:
    """Depth-first over `order`, largest divisors first, each product relation checked when
    its last class is chosen; at most `budget[0]` nodes entered. A loop with an explicit
    stack (a stage with a thousand related classes would exceed Python's recursion limit),
    each choice checked against the relations of its own class only (the others were
    checked when they closed): a captured GPT stage's failing search, 156 s -> 16 s."""
    n = len(order)
    if n == 0:
        return True
    touching: dict[int, list] = {c: [] for c in order}
    for rel in prods:
        for c in set(rel[0] + rel[1]):
            if c in touching:
                touching[c].append(rel)
    budget[0] -= 1
    if budget[0] < 0:
        return False
    tried = [0]  # per depth: how many of its class's candidates were tried
    while tried:
        depth = len(tried) - 1
        c = order[depth]
        choice.pop(c, None)  # the previous candidate of this depth, if any
        if tried[depth] == len(cand[c]):
            tried.pop()  # every candidate failed: back to the parent
            continue
        choice[c] = cand[c][tried[depth]]
        tried[depth] += 1
        if not all(a is None or b is None or a == b
                   for a, b in ((_prod(l, choice), _prod(r, choice))
                                for l, r in touching[c])):
            continue
        if depth + 1 == n:
            return True
        budget[0] -= 1
        if budget[0] >= 0:
            tried.append(0)
    return False
