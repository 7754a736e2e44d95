"""Random evaluation of stages that select by value (tvsmt/encoding/concrete.py): token ids
get small integers while everything else stays real.

A random real never equals a token id, so at real points an embedding selects no row and
every sample of a batch looks the same: a bug that mixes or drops samples is invisible. Small
integers everywhere instead overflow whatever exponentiates large values (attention's softmax
in Megatron-Core's GPTModel: every such point was NaN, and a captured GPTModel whose ranks
each took half the batch ended inconclusive after 18 solver timeouts). The script below is
that case in small: the solver times out on the wrong gradient's stage, and only a point
with integer token ids and real weights shows it wrong."""

from __future__ import annotations

import io
import random
import textwrap

import pytest
from rich.console import Console

from tvsmt.capture import check
from tvsmt.report.render import render
from tvsmt.verify import Options

SCRIPT = """
import os
import torch
import torch.distributed as dist

WORLD_SIZE = 2
VOCAB, HIDDEN, BATCH, SEQ = 8, 4, 4, 2
BUG = os.environ.get("TVSMT_BUG", "")


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, 2)

    def forward(self, tokens):
        # large values exponentiated, as unscaled attention scores are
        return torch.exp(self.out(self.norm(self.emb(tokens))) * 100.0).mean()


def build_single():
    return Model(), torch.randint(0, VOCAB, (BATCH, SEQ))


def build_rank(rank):
    model, tokens = build_single()
    h = BATCH // WORLD_SIZE
    return model, tokens[rank * h:(rank + 1) * h]


def train_step(model, tokens):
    loss = model(tokens)
    loss.backward()
    for p in model.parameters():
        if not (BUG == "norm-grad-unsynced" and p is model.norm.weight):
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    loss = loss.detach().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss
"""


MEAN_OF_MEANS = """
import torch
import torch.distributed as dist

WORLD_SIZE = 2
VOCAB, HIDDEN, BATCH, SEQ = 8, 4, 4, 2


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens, labels):
        logits = self.out(self.norm(self.emb(tokens))).view(-1, VOCAB)
        return torch.nn.functional.cross_entropy(logits, labels.view(-1))  # mean, ignores -100


def build_single():
    return Model(), (torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ)))


def build_rank(rank):
    model, (tokens, labels) = build_single()
    h = BATCH // WORLD_SIZE
    return model, (tokens[rank * h:(rank + 1) * h], labels[rank * h:(rank + 1) * h])


def train_step(model, batch):
    loss = model(*batch)  # the mean over this rank's labels ...
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)  # ... averaged over the ranks
    loss = loss.detach().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "embedding_dp.py"
    path.write_text(textwrap.dedent(SCRIPT))
    return str(path)


def test_a_bug_only_integer_token_ids_show_is_a_violation(script, monkeypatch):
    monkeypatch.setenv("TVSMT_BUG", "norm-grad-unsynced")
    report = check(script, Options(jobs=1, timeout=5))
    assert report.verdict == "violation", [f.message for f in report.failures]
    [bad] = [f for f in report.failures if f.kind == "counterexample"]
    assert bad.tensor == "grad.norm.weight"
    tokens = {k: v for k, v in bad.counterexample["inputs"].items() if "batch" in k}
    weights = {k: v for k, v in bad.counterexample["inputs"].items() if "param" in k}
    assert tokens and all(float(v) == int(float(v)) for v in tokens.values()), tokens
    assert any(float(v) != int(float(v)) for v in weights.values()), weights


def test_the_same_program_without_the_bug_is_proven(script, monkeypatch):
    monkeypatch.delenv("TVSMT_BUG", raising=False)
    report = check(script, Options(jobs=1, timeout=5))
    assert report.verdict == "equivalent", [f.message for f in report.failures]


def test_only_symbols_that_select_alone_get_integers_beside_reals():
    from pysmt.shortcuts import GE, LT, Equals, Ite, Minus, Or, Plus, Real, Symbol, Times
    from pysmt.typing import REAL

    from tvsmt.encoding.concrete import _point, mixed_kinds, point_kinds
    from tvsmt.encoding.stage import Comparison, StageFormula

    tok, lab, w, a, b = (Symbol(n, REAL) for n in ("tok", "lab", "w", "a", "b"))
    # a row chosen by a token id, a label ignored at -100, a vocabulary range of 4 to 8
    # (Megatron's mask), and a maximum of two computed values
    row = Ite(Equals(tok, Real(1)), w, Real(0))
    kept = Ite(Equals(lab, Real(-100)), Real(0), w)
    masked = Ite(Or(LT(tok, Real(4)), GE(Minus(tok, Real(4)), Real(4))), Real(0), w)
    biggest = Ite(GE(Times(a, w), b), Times(a, w), b)
    names = ("tok", "lab", "w", "a", "b")
    f = StageFormula(stage=None, constraints=[],
                     comparisons=[Comparison(0, (), (), Plus(row, kept, masked, biggest), row)],
                     inputs={n: ("s:x", (i,)) for i, n in enumerate(names)})
    assert all(only is None for _, only in point_kinds(f, 2))
    kinds = mixed_kinds(f, int_points_failed=False)  # -100 is out of small integers' reach
    assert [b for b, _ in kinds] == [4, 4, 16, 16, 64, 64]
    branch = {"tok": {1, 3, 4, 5, 7, 8, 9}, "lab": {-100}}
    assert all(only == branch for _, only in kinds)
    mixed = [_point(f, random.Random(k), 16, branch) for k in range(40)]
    assert all(p["tok"] == int(p["tok"]) and p["lab"] == int(p["lab"]) for p in mixed)
    assert any(p["lab"] == -100 for p in mixed) and any(p["lab"] >= 0 for p in mixed)
    assert all(0.5 <= p[n] <= 1.5 for p in mixed for n in ("w", "a", "b"))


def test_a_mean_of_ranks_means_is_a_violation_where_labels_are_ignored(tmp_path):
    """Data parallelism that averages the ranks' mean losses computes the single device's
    mean only when every rank counts as many labels: with labels at cross entropy's ignored
    index (-100) spread unevenly it does not. Small integers never reach -100 (the run was
    inconclusive after 8 rounds of timeouts); the condition's own branch point does."""
    path = tmp_path / "mean_of_means.py"
    path.write_text(textwrap.dedent(MEAN_OF_MEANS))
    report = check(str(path), Options(jobs=1, timeout=5))
    assert report.verdict == "violation", [f.message for f in report.failures]
    found = [f for f in report.failures if f.kind == "counterexample"]
    assert {f.tensor for f in found} >= {"loss", "grad.out.weight"}
    for f in found:
        labels = [v for k, v in f.counterexample["inputs"].items() if "batch.1" in k]
        assert "-100" in labels, (f.tensor, labels)
    # the report shows the token ids and labels before the weights
    out = io.StringIO()
    render(report, Console(file=out, width=2000, color_system=None))
    shown = [line for line in out.getvalue().splitlines() if line.startswith("  inputs: ")]
    assert shown and all("s:batch.1[" in line and "=-100" in line for line in shown), shown


def test_mixed_points_only_where_they_can_tell_more():
    """Selection by value alone, every branch point within small integers' reach and the
    integer points all finite (MoE routing): no mixed points, which would only cost time."""
    from pysmt.shortcuts import Equals, Ite, Real, Symbol
    from pysmt.typing import REAL

    from tvsmt.encoding.concrete import evaluate_at_random, mixed_kinds
    from tvsmt.encoding.stage import Comparison, StageFormula

    idx, w = Symbol("idx", REAL), Symbol("w", REAL)
    routed = Ite(Equals(idx, Real(2)), w, Real(0))
    f = StageFormula(stage=None, constraints=[], comparisons=[Comparison(0, (), (), routed, routed)],
                     inputs={"idx": ("s:i", (0,)), "w": ("s:w", (0,))})
    assert mixed_kinds(f, int_points_failed=False) == []
    assert [b for b, _ in mixed_kinds(f, int_points_failed=True)] == [4, 4, 16, 16, 64, 64]
    assert evaluate_at_random(f).points == 7  # 4 real points and 3 integer ones
