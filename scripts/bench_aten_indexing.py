"""Cost of the exact value-indexing models of the ATen entries (embedding, nll_loss,
index.Tensor by token ids), which keep the indexed vocabulary unreduced under shape reduction.

Builds the symbolic terms (SymbolicBackend) for a vocabulary of V rows and T symbolic token
ids and reports the build time and the number of distinct term nodes, so the price of
never reducing a vocabulary is known.   Usage: python scripts/bench_aten_indexing.py
"""

from __future__ import annotations

import time

import numpy as np

from tvsmt.ops import NodeCtx, SymbolicBackend, all_ops


def _symbols(be, name, shape):
    out = np.empty(shape, dtype=object)
    for idx in np.ndindex(shape):
        out[idx] = be.mgr.Symbol(f"{name}_{'_'.join(map(str, idx))}", be.real)
    return out


def _dag_size(terms) -> int:
    seen, stack = set(), list(terms)
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        stack.extend(t.args())
    return len(seen)


def measure(op: str, vocab: int, tokens: int, hidden: int = 2) -> tuple[float, int]:
    be = SymbolicBackend()
    spec = all_ops()[op]
    ids = _symbols(be, "ids", (tokens,))
    if op == "aten.embedding.default":
        ins = [_symbols(be, "w", (vocab, hidden)), ids]
        attrs = {"args": [{"tensor": 0}, {"tensor": 1}], "kwargs": {}}
    else:  # nll_loss_forward over log-probabilities (tokens, vocab)
        ins = [_symbols(be, "lp", (tokens, vocab)), ids]
        attrs = {"args": [{"tensor": 0}, {"tensor": 1}, None, 1, -100], "kwargs": {}}
    t0 = time.perf_counter()
    outs = spec.forward(be, ins, attrs, NodeCtx())
    elapsed = time.perf_counter() - t0
    terms = [t for o in outs for t in np.asarray(o, dtype=object).ravel()]
    return elapsed, _dag_size(terms)


def main() -> None:
    print(f"{'op':34} {'vocab':>6} {'tokens':>6} {'build s':>8} {'nodes':>8}")
    for op in ("aten.embedding.default", "aten.nll_loss_forward.default"):
        for vocab in (16, 64, 256):
            for tokens in (4, 16):
                s, n = measure(op, vocab, tokens)
                print(f"{op:34} {vocab:6d} {tokens:6d} {s:8.3f} {n:8d}")


if __name__ == "__main__":
    main()
