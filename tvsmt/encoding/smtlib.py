"""Canonical SMT-LIB 2.6 printing of pysmt terms.

Two stages that are identical up to the names of their tensors must give byte-identical
scripts, so that the corpus can store and solve them once. pysmt's own printer is not stable
(declaration order follows internal node ids) and without sharing blows up on softmax, so this
printer walks the term DAG itself, in a fixed order:

* 0-ary symbols are renamed `x0, x1, ...` in first-visit order (post-order, roots in order);
  uninterpreted functions keep their names (`uf_exp`, ...), which carry meaning;
* every non-leaf term used more than once is named once: `(declare-fun d<k> () Real)` and
  `(assert (= d<k> term))`. Equisatisfiable with inlining, and unlike a chain of `define-fun`
  macros (which z3 expands: 11 s for 6000 nested ones here) it stays linear to solve;
* the compared element pairs are named `l<i>`/`r<i>` the same way, so a model reports both.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from fractions import Fraction

import pysmt.operators as op

LOGIC = "QF_UFNRA"

_NARY = {op.PLUS: "+", op.TIMES: "*", op.AND: "and", op.OR: "or", op.MINUS: "-",
         op.EQUALS: "=", op.IFF: "=", op.NOT: "not", op.ITE: "ite", op.LE: "<=", op.LT: "<",
         op.DIV: "/", op.IMPLIES: "=>"}


def _const(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    q = Fraction(value)
    neg, q = q < 0, abs(q)
    body = f"{q.numerator}.0" if q.denominator == 1 else f"(/ {q.numerator}.0 {q.denominator}.0)"
    return f"(- {body})" if neg else body


def _sort(node) -> str:
    t = node.symbol_type() if node.is_symbol() else node.get_type()
    if t.is_bool_type():
        return "Bool"
    if t.is_real_type():
        return "Real"
    if t.is_int_type():
        return "Int"
    raise ValueError(f"unsupported sort {t}")


@dataclass
class Printed:
    text: str
    digest: str
    symbols: dict[str, str]  # canonical name -> original symbol name
    pairs: list[tuple[str, str]]  # (l<i>, r<i>) names, one per comparison, in their order


def pin_symbols(text: str, printed: Printed, inputs: dict[str, Fraction],
                applications: dict[tuple, Fraction]) -> str:
    """The script `text` (printed as `printed`) with its input symbols (by their names before
    printing) fixed at the given values, and the given applications of uninterpreted
    functions ((name, args) -> value) asserted equal to theirs just before `(check-sat)`.

    A real input becomes a constant, `(define-fun x0 () Real v)` in place of its
    declaration, so that the solver's simplifier evaluates the script's ground terms at
    once: asserted as `(= x0 v)` instead, z3 spent up to 7 s, and ran out of a refuted
    obligation's budget, on DeepSpeed's pinned gradient stages that it answers in 0.1-0.3 s
    this way (`get-value` still reports x0). The same constraint, so the same models."""
    canonical = {orig: name for name, orig in printed.symbols.items()}
    values = {canonical[n]: _const(v) for n, v in inputs.items() if n in canonical}
    defined = set()

    def define(m: re.Match) -> str:
        name = m.group(1)
        if name not in values:
            return m.group(0)
        defined.add(name)
        return f"(define-fun {name} () Real {values[name]})"

    text = re.sub(r"^\(declare-fun (\S+) \(\) Real\)$", define, text, flags=re.M)
    # another sort: asserted, as any value the solver must meet
    pins = [f"(assert (= {name} {v}))" for name, v in values.items() if name not in defined]
    pins += [f"(assert (= ({name} {' '.join(_const(a) for a in args)}) {_const(v)}))"
             for (name, args), v in applications.items()]
    at = text.rindex("(check-sat)")
    return text[:at] + "".join(p + "\n" for p in pins) + text[at:]


def print_obligation(constraints: list, pairs: list[tuple[object, object]],
                     logic: str = LOGIC) -> Printed:
    """Script asserting `constraints` and that some pair differs, ending with (check-sat).
    A pair given again (the same two terms: e.g. a tensor replicated on the 8 ranks of a
    tensor-parallel group, each rank's copy compared with the same single element) is
    stated once, its names given to each occurrence (`Printed.pairs` stays one per pair):
    the disjunction is the same. The 128-rank tp8 real plan's largest obligation holds 2048
    pairs, 256 distinct: z3 took 0.13 s for it, 0.04 s for the pairs stated once."""
    distinct = list(dict.fromkeys(pairs))
    roots = list(constraints) + [t for pair in distinct for t in pair]

    # nodes keyed by id(): pysmt's FNode.__hash__ is a Python method, called on every lookup
    # (the terms live as long as the formula, so no id is reused meanwhile)
    refs: dict = {}
    stack = list(reversed(roots))
    while stack:  # reference counts over the DAG
        n = stack.pop()
        k = id(n)
        if k in refs:
            refs[k] += 1
            continue
        refs[k] = 1
        stack.extend(reversed(n.args()))

    names: dict = {}  # id(node) -> its textual form (name or inline expression)
    symbols: dict[str, str] = {}
    functions: dict[str, str] = {}
    defines: list[str] = []

    def emit(root) -> str:
        work = [(root, False)]
        while work:
            n, expanded = work.pop()
            if id(n) in names:
                continue
            if n.is_symbol():
                canon = f"x{len(symbols)}"
                symbols[canon] = n.symbol_name()
                names[id(n)] = canon
                decls.append(f"(declare-fun {canon} () {_sort(n)})")
                continue
            if n.is_constant():
                names[id(n)] = _const(n.constant_value())
                continue
            if not expanded:
                work.append((n, True))
                for a in reversed(n.args()):
                    if id(a) not in names:
                        work.append((a, False))
                continue
            args = " ".join([names[id(a)] for a in n.args()])
            if n.is_function_application():
                f = n.function_name()
                fname = f.symbol_name()
                if fname not in functions:
                    ft = f.symbol_type()
                    params = " ".join("Real" if p.is_real_type() else "Bool"
                                      for p in ft.param_types)
                    functions[fname] = f"(declare-fun {fname} ({params}) Real)"
                text = f"({fname} {args})"
            else:
                kind = n.node_type()
                if kind not in _NARY:
                    raise ValueError(f"cannot print operator {op.op_to_str(kind)}")
                text = f"({_NARY[kind]} {args})"
            if refs.get(id(n), 0) > 1:
                name = f"d{len(defines)}"
                defines.append(f"(declare-fun {name} () {_sort(n)})\n(assert (= {name} {text}))")
                names[id(n)] = name
            else:
                names[id(n)] = text
        return names[id(root)]

    decls: list[str] = []
    asserts = [f"(assert {emit(c)})" for c in constraints]
    pair_defs: list[str] = []
    diffs: list[str] = []
    named: dict = {}  # pair -> its names
    for i, (lhs, rhs) in enumerate(distinct):
        lt, rt = emit(lhs), emit(rhs)
        pair_defs.append(f"(declare-fun l{i} () Real)\n(assert (= l{i} {lt}))")
        pair_defs.append(f"(declare-fun r{i} () Real)\n(assert (= r{i} {rt}))")
        named[(lhs, rhs)] = (f"l{i}", f"r{i}")
        diffs.append(f"(not (= l{i} r{i}))")
    pair_names = [named[pair] for pair in pairs]
    goal = diffs[0] if len(diffs) == 1 else f"(or {' '.join(diffs)})" if diffs else "false"
    lines = [f"(set-logic {logic})", "(set-option :produce-models true)"]
    lines += [functions[k] for k in sorted(functions)]
    lines += decls + defines + pair_defs + asserts
    lines += [f"(assert {goal})", "(check-sat)"]
    text = "\n".join(lines) + "\n"
    return Printed(text, hashlib.sha256(text.encode()).hexdigest(), symbols, pair_names)
