"""A small SMT-LIB s-expression reader, for the answers to `(get-value ...)`.

Value forms handled (into `Fraction`):
  numerals and decimals      `3`, `3.0`, `0.25`
  negation                   `(- 3.0)`, `(- 1)`
  division                   `(/ 1.0 2.0)`, `(/ (- 1) 4)`, `(- (/ 1 4))`
  (also `+`/`*` of such terms, which some solver versions print)
Anything else (z3's `(root-obj ...)`, cvc5's `(_ real_algebraic_number ...)`, booleans, UF
interpretations) is kept as its canonical text, a `str`.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Union

SExpr = Union[str, list]  # an atom (token text) or a list of SExpr

_TOKEN = re.compile(
    r'\s+|;[^\n]*'                 # whitespace, comments (skipped)
    r'|(\()|(\))'                  # parentheses
    r'|("(?:[^"]|"")*")'           # string literal ("" is an escaped quote)
    r'|(\|[^|]*\|)'                # quoted symbol
    r'|(<[^<>()]*(?:\([^()]*\)[^<>()]*)*>'  # cvc5's `<1*x^2 + (-2), (5/4, 3/2)>` (one atom)
    r'|[^\s()";|]+)'               # any other atom
)


class SExprError(ValueError):
    """Text that is not a well-formed s-expression (or not a get-value answer)."""


def parse_all(text: str) -> list[SExpr]:
    """Every top-level s-expression of `text`, in order."""
    stack: list[list] = [[]]
    pos, n = 0, len(text)
    match = _TOKEN.match
    while pos < n:
        m = match(text, pos)
        if m is None:
            raise SExprError(f"unexpected character {text[pos]!r} at offset {pos}")
        pos = m.end()
        lp, rp, string, quoted, atom = m.groups()
        if lp:
            stack.append([])
        elif rp:
            if len(stack) == 1:
                raise SExprError(f"unbalanced ')' at offset {m.start()}")
            done = stack.pop()
            stack[-1].append(done)
        elif string or quoted or atom:
            stack[-1].append(string or quoted or atom)
    if len(stack) != 1:
        raise SExprError("unbalanced '(': missing ')' at end of input")
    return stack[0]


def parse(text: str) -> SExpr:
    """Exactly one s-expression."""
    items = parse_all(text)
    if len(items) != 1:
        raise SExprError(f"expected one s-expression, found {len(items)}")
    return items[0]


def to_text(node: SExpr) -> str:
    """Canonical text of a parsed node (single spaces)."""
    if isinstance(node, str):
        return node
    return "(" + " ".join(to_text(x) for x in node) + ")"


_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]*)?\Z")


def to_value(node: SExpr) -> Fraction | str:
    """An exact rational if `node` is a rational constant term, else its text."""
    try:
        return _rational(node)
    except _NotRational:
        return to_text(node)


class _NotRational(Exception):
    pass


def _rational(node: SExpr) -> Fraction:
    if isinstance(node, str):
        if _NUMBER.match(node):
            return Fraction(node)
        raise _NotRational
    if not node or not isinstance(node[0], str):
        raise _NotRational
    op, args = node[0], node[1:]
    if op == "-" and len(args) == 1:
        return -_rational(args[0])
    if op == "-" and len(args) > 1:
        acc = _rational(args[0])
        for a in args[1:]:
            acc -= _rational(a)
        return acc
    if op == "/" and len(args) >= 2:
        acc = _rational(args[0])
        for a in args[1:]:
            d = _rational(a)
            if d == 0:
                raise _NotRational
            acc /= d
        return acc
    if op == "+" and args:
        return sum((_rational(a) for a in args), Fraction(0))
    if op == "*" and args:
        acc = Fraction(1)
        for a in args:
            acc *= _rational(a)
        return acc
    raise _NotRational


def unquote_symbol(sym: str) -> str:
    """`|a b|` -> `a b`; other symbols unchanged."""
    if len(sym) >= 2 and sym[0] == "|" and sym[-1] == "|":
        return sym[1:-1]
    return sym


def parse_get_value(text: str) -> dict[str, Fraction | str]:
    """Parse the answer of one or more `(get-value ...)` commands: `((x 1.0) (y (/ 1 2)))`.

    Keys are symbol names without `|...|` quoting; a non-symbol term keeps its text as key.
    """
    out: dict[str, Fraction | str] = {}
    for answer in parse_all(text):
        if isinstance(answer, str):
            raise SExprError(f"expected a get-value answer list, got {answer!r}")
        for pair in answer:
            if isinstance(pair, str) or len(pair) != 2:
                raise SExprError(f"expected a (term value) pair, got {to_text(pair)!r}")
            key = pair[0]
            name = unquote_symbol(key) if isinstance(key, str) else to_text(key)
            out[name] = to_value(pair[1])
    return out
