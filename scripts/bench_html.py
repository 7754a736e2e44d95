#!/usr/bin/env python3
"""Size and opening time of HTML reports of real plans (issue 14: "reports of the big real
plans stay under a few MB and open in under 2 s").

For each pair it verifies the plans, writes the HTML report, and times headless Chromium
loading it (`--dump-dom`, which returns once the page is loaded and its scripts ran), minus
the time Chromium takes on an empty page measured in the same run.

    python scripts/bench_html.py                       # br0, the 8-rank and the big llama3 plans
    python scripts/bench_html.py --pairs br0-llama3-ly1-dp2pp2tp2mb2
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT.parent / "shared" / "plans"
PAIRS = ["br0-llama3-ly1-dp2pp2tp2mb2", "llama3-ly2-dp2pp2tp2mb2", "llama3-ly2-dp16pp4tp2mb8",
         "llama3-ly2-dp4pp4tp8mb8"]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def load_seconds(chromium: str, url: str, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as profile:
            t = time.perf_counter()
            subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                           capture_output=True, timeout=300)
            best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", nargs="*", default=PAIRS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from tvsmt.report.html import write_html
    from tvsmt.verify import Options, verify_pair

    chromium = shutil.which("chromium")
    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "empty.html"
        empty.write_text("<!doctype html><html><body></body></html>")
        floor = load_seconds(chromium, empty.as_uri()) if chromium else float("nan")
        print(f"{'pair':34} {'verdict':12} {'stages':>7} {'HTML MB':>8} {'open s':>7}")
        for name in args.pairs:
            folder = PLANS / name
            report = verify_pair(str(folder / "single.json.gz"),
                                 str(folder / "parallel.json.gz"), Options(jobs=2))
            out = Path(tmp) / f"{name}.html"
            write_html(report, str(out))
            size = os.path.getsize(out) / 1e6
            opened = (load_seconds(chromium, out.as_uri()) - floor) if chromium else float("nan")
            print(f"{name:34} {report.verdict:12} {report.stages_total:7d} {size:8.2f} "
                  f"{opened:7.2f}")
        print(f"\nChromium on an empty page: {floor:.2f} s (subtracted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
