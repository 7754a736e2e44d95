"""Data passed between encoding and solving: an obligation in, a verdict out."""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

# Where solvers are driven from by default (runner.solve_all). Solving is the solvers' work,
# in their own processes: threads of this process drive them at no start-up cost, where
# joblib's loky worker processes cost ~0.3 s a run (scripts/bench_solvers.py, 25 obligations,
# z3, 2 jobs: 3.2 against 31.7 ms an obligation); "loky" and "dask" remain choices.
DEFAULT_BACKEND = "threading"


@dataclass(frozen=True)
class Obligation:
    """One SMT-LIB 2.6 script that is `unsat` exactly when its stage is proven.

    `smt2` is the complete, canonical script (set-logic ... check-sat, then a get-value of
    `query` if sat); `digest` is the sha256 of `smt2` (the corpus file name). `query` lists the
    canonical symbol names whose values a counterexample needs. `meta` (stage ids, plan tensors)
    is for headers and reports only: it never enters the hashed text.
    """

    digest: str
    smt2: str
    query: tuple[str, ...] = ()
    meta: dict = field(default_factory=dict, compare=False, hash=False)


# Status values of a SolverResult.
UNSAT, SAT, UNKNOWN, TIMEOUT, ERROR = "unsat", "sat", "unknown", "timeout", "error"


@dataclass
class SolverResult:
    status: str  # one of UNSAT, SAT, UNKNOWN, TIMEOUT, ERROR
    solver: str  # profile name, e.g. "z3"
    version: str = ""
    seconds: float = 0.0
    values: dict[str, Fraction | str] = field(default_factory=dict)  # for SAT: query symbol -> value
    message: str = ""  # error text / reason for unknown
    # crosscheck: the raw result of each solver (the fields above are the reconciled verdict)
    details: list["SolverResult"] = field(default_factory=list)
    profile: str = ""  # sha256 of the solver profile file that produced it ("" if combined)

    @property
    def proven(self) -> bool:
        return self.status == UNSAT
