"""The PyTorch capture frontend: a training script in, an execplan pair (and a verdict) out.

    pair = capture("train.py")            # CapturedPair: single + parallel execplan dicts
    report = check("train.py")             # capture, then verify with the hypothesis driver
    with microbatch(i): ...                # in the script: mark micro-batch i (reports say it)

See docs/capture.md for the script convention, what is proven and what is assumed.
"""

from __future__ import annotations

from tvsmt.capture.build import CapturedPair, capture_pair
from tvsmt.capture.driver import CaptureReport, check, check_pair, write_pair
from tvsmt.capture.markers import microbatch

capture = capture_pair

__all__ = ["CapturedPair", "CaptureReport", "capture", "capture_pair", "check", "check_pair",
           "microbatch", "write_pair"]
