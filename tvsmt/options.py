"""What one verification is asked to do (`Options`) and the solver profiles that means:
read by every phase, so it lives apart from them (tvsmt/pipeline.py composes the phases,
tvsmt/solving/dispatch.py runs the solvers; neither needs the other for it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tvsmt.solving.types import DEFAULT_BACKEND

#: `--crosscheck` without a list
DEFAULT_CROSSCHECK = ("z3", "cvc5")


@dataclass
class Options:
    """What a verification is asked to do (the CLI's flags; tvsmt/verify.py's callers)."""

    jobs: int | None = None
    solver: str = "z3"
    timeout: float = 60.0
    # True: z3 and cvc5; or the profiles (names or paths) that must all prove each stage
    crosscheck: bool | str | tuple[str, ...] = False
    corpus: str | None = None
    fresh: bool = False
    backend: str = DEFAULT_BACKEND
    scheduler: str | None = None
    fold: bool = True  # replica folding (tvsmt/fold) when the plan has > 2 replicas or mbs
    strict: bool = False  # parallel results that no lineage claims make the run fail
    # solver seconds for the stages that prove hypotheses (None: `timeout`); the capture's
    # driver sets it once a confirmed bug decides the verdict (policy.py)
    hypothesis_budget: float | None = None
    progress: Callable[[str, int, int | None], None] | None = None  # (phase, done, total)

    def __post_init__(self):
        check_solver_choice(self.solver, self.crosscheck)


def solver_names(opts: "Options") -> tuple[str, ...]:
    """The solver profiles (names or paths) a run uses."""
    return crosscheck_list(opts.crosscheck) or (opts.solver,)


def crosscheck_list(value: "bool | str | Sequence[str]") -> tuple[str, ...]:
    """The solvers of a `crosscheck` option: True = z3 and cvc5; "a,b" or ["a", "b"] as given
    (False/empty: none)."""
    if value is True:
        return DEFAULT_CROSSCHECK
    if not value:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(s.strip() for s in items if s.strip())


def check_solver_choice(solver: str, crosscheck: "bool | str | Sequence[str]") -> None:
    """ValueError unless the choice is one solver, or a cross-check of two or more distinct
    profiles (without a separate `solver`)."""
    names = crosscheck_list(crosscheck)
    if crosscheck is not False and crosscheck is not None and not names:
        raise ValueError("--crosscheck got an empty list of solvers")
    if not names:
        return
    if solver != "z3":
        raise ValueError("--crosscheck takes its solvers as a list (--crosscheck z3,cvc5); "
                         "it takes no --solver")
    from tvsmt.solving.profiles import get_profile

    profiles = [get_profile(n).name for n in names]  # an unknown profile: ProfileError
    if len(names) < 2 or len(set(profiles)) != len(profiles):
        raise ValueError(f"--crosscheck needs two or more distinct solver profiles, got "
                         f"{', '.join(names)}")
