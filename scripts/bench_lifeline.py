"""Cost of the lifeline on solver start-up (tvsmt/solving/lifeline.py): a plain start, a start
through `setpriv --pdeathsig KILL` (what tvsmt uses where setpriv exists) and one with a
`preexec_fn` doing the prctl (the fallback), from processes holding more and more memory.

A `preexec_fn` makes subprocess fork instead of vfork, so it costs more in a large process.

    python scripts/bench_lifeline.py [--mb 0,1000,4000] [--n 40]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

from tvsmt.solving import lifeline
from tvsmt.solving.profiles import find_binary, get_profile


def spawn_ms(argv: list[str], n: int, preexec) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, preexec_fn=preexec,
                       start_new_session=True, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", default="0,1000,4000", help="resident memory to hold, in MB")
    ap.add_argument("--n", type=int, default=40)
    args = ap.parse_args()
    z3 = find_binary(get_profile("z3"))
    argv = [z3, "--version"]
    wrapped, _ = lifeline.spawn_args(argv)
    print(f"{'held MB':>8} {'plain ms':>9} {'setpriv ms':>11} {'preexec_fn ms':>14}")
    ballast = []
    for mb in (int(x) for x in args.mb.split(",")):
        ballast = [bytearray(b"x" * (1 << 20)) for _ in range(mb)]  # touched pages
        plain = spawn_ms(argv, args.n, None)
        setpriv = spawn_ms(wrapped, args.n, None) if wrapped != argv else float("nan")
        armed = spawn_ms(argv, args.n, lifeline.preexec())
        print(f"{mb:>8} {plain:>9.2f} {setpriv:>11.2f} {armed:>14.2f}")
    del ballast


if __name__ == "__main__":
    main()
