"""Every generated configuration verifies `equivalent` (issue 4, item 1): dp, tp, pp in
{1, 2, 4}, mb in {1, 2, 4}, 1 and 2 layers, Llama3 (small dims; shape reduction makes the
real sizes cheap anyway)."""

from __future__ import annotations

import itertools

import pytest

from tvsmt.frontends import generate_pair
from tvsmt.plan import plan_from_dict
from tvsmt.plan.reader import check_pair
from tvsmt.verify import Options, verify_plans

# (layers, dp, tp, pp, mb); a pipeline stage needs at least one layer, so pp=4 is checked
# with 4 layers as well.
CONFIGS = [c for c in itertools.product([1, 2], [1, 2, 4], [1, 2, 4], [1, 2, 4], [1, 2, 4])
           if c[3] <= c[0]]
CONFIGS += [(4, dp, tp, 4, mb) for dp in (1, 2) for tp in (1, 2) for mb in (1, 2)]


@pytest.mark.parametrize("layers,dp,tp,pp,mb", CONFIGS, ids=lambda v: str(v))
def test_generated_llama3_is_equivalent(layers, dp, tp, pp, mb):
    single, parallel = generate_pair("llama3", layers=layers, hidden=32, heads=4, ffn=32,
                                     vocab=16, seq=4, dp=dp, tp=tp, pp=pp, mb=mb)
    s, p = plan_from_dict(single, "single"), plan_from_dict(parallel, "parallel")
    check_pair(s, p)
    report = verify_plans(s, p, Options(jobs=1))
    assert report.verdict == "equivalent", report.failures[:2]
    assert report.stages_proven == report.stages_total > 0
