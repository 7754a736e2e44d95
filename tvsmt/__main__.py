"""`python -m tvsmt ...`: the `tvsmt` command (scripts/bench_real.py times it this way)."""

from tvsmt.cli import main

if __name__ == "__main__":
    main(prog_name="tvsmt")
