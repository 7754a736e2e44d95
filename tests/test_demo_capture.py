"""`tvsmt demo`'s capture part: the user's TP MLP is proven, the copy without its forward
all-reduce is a violation whose report points at the user's code lines."""

from __future__ import annotations

import io

from rich.console import Console

from tvsmt.demo import MLP_BUG, MLP_SCRIPT, run_capture_demo


def test_capture_demo_proves_the_mlp_and_points_at_the_broken_code(tmp_path):
    out = io.StringIO()
    console = Console(file=out, width=200)
    assert run_capture_demo(console, str(tmp_path)) is True
    text = out.getvalue()
    assert "verdict: equivalent" in text and "verdict: violation" in text
    assert "bug: the all-reduce is gone" in text  # the changed code is shown
    forward = MLP_SCRIPT.splitlines().index(
        "        return ReduceFromTP.apply(y) if self.tp else y") + 1
    assert f"tp_mlp_bug.py:{forward}" in text.split("verdict: violation")[1]
    assert MLP_BUG[0] in MLP_SCRIPT and (tmp_path / "tp_mlp_bug.py").exists()
