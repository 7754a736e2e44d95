"""Measure per-obligation solver overhead: fresh process per script vs one kept-alive process.

    .venv/bin/python scripts/bench_solvers.py [--count 300] [--solvers z3,cvc5] [--jobs 2]

Generates small reduced-shape stages in QF_UFNRA (matmul split over ranks + all-reduce,
RMSNorm with an uninterpreted rsqrt, softmax with uninterpreted exp and division, gradient
accumulation over micro-batches), each in an equivalent (unsat) and a buggy (sat) version, and
solves them (a) one `file` process per obligation, (b) one fresh stdin process per obligation,
(c) one kept-alive stdin process with (reset) in between, (d) solve_all on all cores, its
solvers driven by threads of this process and by loky worker processes (started cold, as in
one `tvsmt verify`, and warm).
Numbers of the last run are in tvsmt/solvers/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tvsmt.solving.profiles import get_profile  # noqa: E402
from tvsmt.solving.runner import run_file, script_prefix, solve_all, solve_batch  # noqa: E402
from tvsmt.solving.types import Obligation  # noqa: E402


def _sum(terms):
    terms = list(terms)
    return terms[0] if len(terms) == 1 else "(+ " + " ".join(terms) + ")"


class _Script:
    def __init__(self):
        self.decls, self.defs, self.n = [], [], 0

    def var(self, name):
        self.decls.append(f"(declare-fun {name} () Real)")
        return name

    def define(self, term):
        self.n += 1
        name = f"t{self.n}"
        self.defs.append(f"(define-fun {name} () Real {term})")
        return name

    def text(self, ufs, pairs, query):
        diff = " ".join(f"(not (= {a} {b}))" for a, b in pairs)
        lines = ["(set-logic QF_UFNRA)"] + [f"(declare-fun {u} ({' '.join(['Real'] * k)}) Real)"
                                           for u, k in ufs]
        lines += self.decls + self.defs
        lines += [f"(assert (or {diff}))" if len(pairs) > 1 else f"(assert {diff})",
                  "(check-sat)", f"(get-value ({' '.join(query)}))"]
        return "\n".join(lines) + "\n"


def matmul(rng, buggy, scale=1):
    m, k, n, r = rng.randint(1, 3), rng.choice([2, 4, 6]) * scale, rng.randint(1, 3), rng.choice([2, 3])
    s = _Script()
    a = [[s.var(f"a_{i}_{j}") for j in range(k)] for i in range(m)]
    b = [[s.var(f"b_{i}_{j}") for j in range(n)] for i in range(k)]
    shards = [list(range(k))[q::r] for q in range(r)]
    pairs = []
    for i in range(m):
        for j in range(n):
            ref = s.define(_sum(f"(* {a[i][t]} {b[t][j]})" for t in range(k)))
            parts = []
            for q, sh in enumerate(shards):
                idx = sh[:-1] if buggy and q == 0 and i == m - 1 and j == n - 1 else sh
                parts.append(s.define(_sum(f"(* {a[i][t]} {b[t][j]})" for t in idx) if idx else "0.0"))
            pairs.append((ref, s.define(_sum(parts))))
    return s.text([], pairs, [a[0][0], b[0][0]])


def rmsnorm(rng, buggy, scale=1):
    d, r = rng.choice([2, 4, 6, 8]) * scale, 2
    s = _Script()
    x = [s.var(f"x_{i}") for i in range(d)]
    g = [s.var(f"g_{i}") for i in range(d)]
    ref_ss = s.define(_sum(f"(* {v} {v})" for v in x))
    ref_scale = s.define(f"(uf_rsqrt (+ (/ {ref_ss} {d}.0) 0.00001))")
    parts = [s.define(_sum(f"(* {v} {v})" for v in x[q::r])) for q in range(r)]
    par_ss = s.define(_sum(parts))
    denom = f"{d // r}.0" if buggy else f"{d}.0"
    par_scale = s.define(f"(uf_rsqrt (+ (/ {par_ss} {denom}) 0.00001))")
    pairs = [(s.define(f"(* {x[i]} {ref_scale} {g[i]})"), s.define(f"(* {g[i]} {x[i]} {par_scale})"))
             for i in range(d)]
    return s.text([("uf_rsqrt", 1)], pairs, x[:2])


def softmax(rng, buggy, scale=1):
    c, r = rng.choice([2, 4, 8]) * scale, 2
    s = _Script()
    x = [s.var(f"x_{i}") for i in range(c)]
    e = [s.define(f"(uf_exp {v})") for v in x]
    total = s.define(_sum(e))
    local = [s.define(_sum(e[q::r])) for q in range(r)]
    reduced = s.define(_sum(local))
    pairs = []
    for i in range(c):
        den = local[i % r] if buggy else reduced
        pairs.append((s.define(f"(* {e[i]} (uf_recip {total}))"),
                      s.define(f"(* {e[i]} (uf_recip {den}))")))
    return s.text([("uf_exp", 1), ("uf_recip", 1)], pairs, x[:2])


def gradacc(rng, buggy, scale=1):
    bsz, mb = rng.choice([4, 6, 8]) * scale, 2
    s = _Script()
    x = [s.var(f"x_{i}") for i in range(bsz)]
    dy = [s.var(f"dy_{i}") for i in range(bsz)]
    w = s.var("w")
    ref = s.define(f"(/ {_sum(f'(* {x[i]} {dy[i]} {w})' for i in range(bsz))} {bsz}.0)")
    per = bsz // mb
    div = per if buggy else bsz
    parts = [s.define(f"(/ {_sum(f'(* {w} {x[i]} {dy[i]})' for i in range(q * per, (q + 1) * per))} {div}.0)")
             for q in range(mb)]
    return s.text([], [(ref, s.define(_sum(parts)))], [x[0], dy[0], w])


def make(count: int, seed: int = 0, scale: int = 1) -> list[Obligation]:
    rng = random.Random(seed)
    kinds = [matmul, rmsnorm, softmax, gradacc]
    out = []
    for i in range(count):
        text = kinds[i % 4](rng, buggy=bool((i // 4) % 2), scale=scale)
        text = f"; bench {i}\n" + text  # distinct digests
        query = tuple(text.rsplit("(get-value (", 1)[1].split("))")[0].split())
        out.append(Obligation(hashlib.sha256(text.encode()).hexdigest(), text, query))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--solvers", default="z3,cvc5")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=20)
    ap.add_argument("--scale", type=int, default=1, help="multiply stage dimensions")
    args = ap.parse_args()
    obs = make(args.count, scale=args.scale)
    print(f"{len(obs)} obligations, {statistics.mean(len(o.smt2) for o in obs):.0f} chars avg, "
          f"{os.cpu_count()} cores")
    for name in args.solvers.split(","):
        prof = get_profile(name)
        rows = []
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for o in obs:
                p = os.path.join(d, o.digest + ".smt2")
                Path(p).write_text(script_prefix(o.smt2) + "\n")  # no get-value after unsat
                paths.append(p)
            t = time.perf_counter()
            file_res = [run_file(p, prof, args.timeout) for p in paths]
            rows.append(("file, fresh process", time.perf_counter() - t, file_res))
        t = time.perf_counter()
        fresh = solve_batch(obs, replace(prof, mode="fresh"), args.timeout)
        rows.append(("stdin, fresh process", time.perf_counter() - t, fresh))
        t = time.perf_counter()
        kept = solve_batch(obs, prof, args.timeout)
        rows.append(("stdin, kept alive", time.perf_counter() - t, kept))
        for backend, state in (("threading", ""), ("loky", " cold"), ("loky", " warm")):
            # cold: loky starts its workers (as in one `tvsmt verify`); threads cost nothing
            t = time.perf_counter()
            par = solve_all(obs, prof, jobs=args.jobs, timeout_s=args.timeout, backend=backend)
            rows.append((f"solve_all {backend}{state} jobs={args.jobs or 'all'}",
                         time.perf_counter() - t, par))
        for label, secs, res in rows:
            counts = {}
            for r in res:
                counts[r.status] = counts.get(r.status, 0) + 1
            med = statistics.median(r.seconds for r in res) * 1000
            print(f"{name:6} {label:26} {secs / len(res) * 1000:7.2f} ms/obligation wall "
                  f"(median solve {med:6.2f} ms)  {dict(sorted(counts.items()))}")
        slow = sorted(res, key=lambda r: -r.seconds)[:3]
        print(f"{name:6} slowest: {[round(r.seconds, 2) for r in slow]}")


if __name__ == "__main__":
    main()
