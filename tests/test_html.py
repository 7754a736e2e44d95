"""The HTML report (issue 14): self-contained, the failing stage drawn, values shown; opened
in headless Chromium (Debian's package; .ci/run installs it) and checked from the DOM and a
screenshot."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from click.testing import CliRunner
from conftest import fixture_pair
from handmade import parallel_mlp, single_mlp

from tvsmt.cli import main

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DOT = shutil.which("dot")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _html_of(tmp_path, single, parallel, name="r"):
    out, rep = tmp_path / f"{name}.html", tmp_path / f"{name}.json"
    r = CliRunner().invoke(main, ["verify", single, parallel, "--no-corpus", "--html", str(out),
                                  "--report", str(rep)])
    assert r.exit_code == 1, r.output
    return out, rep


@pytest.fixture
def mlp_bug(tmp_path):
    s, p = tmp_path / "s.json", tmp_path / "p.json"
    s.write_text(json.dumps(single_mlp()))
    p.write_text(json.dumps(parallel_mlp(drop_allreduce=True)))
    return _html_of(tmp_path, str(s), str(p))


def _self_contained(text: str) -> None:
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), "external resource"
    assert "<script src" not in text and "<link" not in text


def test_generated_counterexample_report_shows_the_tensor_values_and_drawing(mlp_bug):
    html, _ = mlp_bug
    text = html.read_text()
    _self_contained(text)
    assert "verdict: <span class=violation>violation" in text
    assert "class='mono differs'>y[0,0]" in text  # the failing element, highlighted
    assert "reduced shape <b>[4, 2]</b>" in text
    assert 'data-status=violated' in text and 'data-status=proven' in text  # stage table
    if DOT:
        assert "<svg" in text and "identity" in text  # the injected node is drawn


def test_br0_report_shows_the_underivable_claim(tmp_path):
    html, _ = _html_of(tmp_path, *fixture_pair("br0-llama3-ly1-dp2pp2tp2mb2"))
    text = html.read_text()
    _self_contained(text)
    assert "t355v1@r0m0" in text and "underivable from" in text
    assert html.stat().st_size < 3_000_000


def test_report_command_writes_html_from_a_saved_report(mlp_bug, tmp_path):
    _, rep = mlp_bug
    out = tmp_path / "again.html"
    r = CliRunner().invoke(main, ["report", str(rep), "--html", str(out)])
    assert r.exit_code == 1 and out.exists()
    assert "class='mono differs'>y[0,0]" in out.read_text()


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian's "
                    "package chromium; .ci/run installs it)")
def test_chromium_renders_the_failing_tensor_and_its_values(mlp_bug, tmp_path):
    html, rep = mlp_bug
    url = html.resolve().as_uri()
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'u1'}", "--dump-dom",
                          url], capture_output=True, text=True, timeout=120).stdout
    assert "violation" in dom and "y[0,0]" in dom
    single = json.loads(rep.read_text())["failures"][0]["counterexample"]["mismatches"][0]
    assert f'<td class="mono">{single["single"]}</td>' in dom  # the single side's value
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'u2'}",
                    "--window-size=1200,900", f"--screenshot={shot}", url],
                   capture_output=True, timeout=120)
    import numpy as np
    from PIL import Image

    img = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert img.shape == (900, 1200, 3)
    # the failure's red frame and the red verdict are on the first screen
    r, g, b = img[..., 0], img[..., 1], img[..., 2]
    red = int(((r > 180) & (g < 80) & (b < 80)).sum())
    assert red > 200, red
