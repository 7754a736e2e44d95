"""Randomly damaged plans never produce a traceback: every outcome is a verdict or a one-line
error with exit code 2 (fixed seeds, so a failure is reproducible)."""

from __future__ import annotations

import copy
import json
import random

import pytest
from click.testing import CliRunner
from handmade import parallel_mlp, single_mlp

from tvsmt.cli import main

JUNK = [None, -1, 0, 7, 2.5, "x", "", [], {}, [1, "a"], {"a": 1}, True, [[0, 99]]]


def _damage(plan: dict, rng: random.Random) -> None:
    """Replace one value somewhere in the plan by junk (or delete a key)."""
    node = plan
    path = []
    while isinstance(node, (dict, list)) and node and rng.random() < 0.8:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append((node, key))
        node = node[key]
    if not path:
        return
    parent, key = path[-1]
    if isinstance(parent, dict) and rng.random() < 0.3:
        del parent[key]
    else:
        parent[key] = copy.deepcopy(rng.choice(JUNK))


@pytest.mark.parametrize("seed", range(150))
def test_damaged_plans_give_verdicts_or_one_line_errors(tmp_path, seed):
    rng = random.Random(seed)
    single, parallel = single_mlp(), parallel_mlp(dp=1, tp=2)
    for _ in range(rng.randint(1, 3)):
        _damage(rng.choice([single, parallel]), rng)
    s, p = tmp_path / "s.json", tmp_path / "p.json"
    s.write_text(json.dumps(single))
    p.write_text(json.dumps(parallel))
    result = CliRunner().invoke(main, ["verify", str(s), str(p), "--no-corpus", "--jobs", "1"])
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        (seed, repr(result.exception))
    assert result.exit_code in (0, 1, 2), result.output
    if result.exit_code == 2 and "verdict" not in result.output:
        assert len(result.output.strip().splitlines()) == 1, result.output
