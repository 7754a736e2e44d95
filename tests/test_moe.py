"""Mixture-of-experts plans: the real nnScaler MoE pairs get their verdicts, the MoE bugs of
the catalogue are caught in them and in generated DeepSeek-V3-style plans, and the generated
MoE plans verify `equivalent` across dp / tp (= ep) / pp / mb."""

from __future__ import annotations

import itertools

import pytest
from conftest import fixture_pair

from tvsmt.frontends import generate_pair
from tvsmt.frontends.builder import read_plan_dict
from tvsmt.frontends.mutations import MUTATIONS, NotApplicable, apply
from tvsmt.plan import load_plan, plan_from_dict
from tvsmt.plan.reader import check_pair
from tvsmt.verify import Options, verify_plans

MOE_BUGS = [name for name in MUTATIONS if name.startswith("moe-")]


def _verify(single, parallel, **kw):
    return verify_plans(single, parallel, Options(jobs=1, **kw))


def _real(name):
    s_path, p_path = fixture_pair(name)
    return load_plan(s_path), p_path


@pytest.mark.parametrize("name", ["moe-ly4-dp2pp2tp2mb2", "llama3moe-ly2-dp2pp2tp2mb2"])
def test_real_moe_pairs_are_equivalent(name):
    single, p_path = _real(name)
    report = _verify(single, load_plan(p_path))
    assert report.verdict == "equivalent", report.failures[:2]
    assert report.stages_proven == report.stages_total > 0


@pytest.mark.slow
def test_real_moe_128_ranks_is_equivalent():
    single, p_path = _real("moe-ly2-dp16pp2tp4mb16")
    report = verify_plans(single, load_plan(p_path), Options(jobs=2))
    assert report.verdict == "equivalent", report.failures[:2]


# Bugs that fit the real plans (they have no auxiliary loss).
REAL_BUGS = [b for b in MOE_BUGS if b != "moe-aux-grad-scaled-by-tp"]


@pytest.fixture(scope="module")
def llama3moe():
    single, p_path = _real("llama3moe-ly2-dp2pp2tp2mb2")
    return single, read_plan_dict(p_path)


@pytest.mark.parametrize("bug", REAL_BUGS)
def test_bug_in_a_real_moe_plan_is_caught(llama3moe, bug):
    single, parallel = llama3moe
    broken, record = apply(parallel, bug, seed=1)
    report = _verify(single, plan_from_dict(broken, "broken"), timeout=5)
    assert report.verdict == "violation", (record, report.failures[:1])


def test_real_plans_have_no_auxiliary_loss(llama3moe):
    with pytest.raises(NotApplicable):
        apply(llama3moe[1], "moe-aux-grad-scaled-by-tp")
