"""The plan generator and the bug zoo, checked numerically (no solver).

* every lineage of every generated parallel plan holds on random concrete inputs, for a grid
  of dp x tp x pp x mb x layers, llama3 and mlp;
* the single plans compute what PyTorch autograd computes (loss and every weight gradient);
* every mutation breaks the numeric check (or, for the graph-breaking one, the evaluation);
* the plans pass the plan reader; the CLI works.
"""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from numeric_eval import UndefinedTensor, check_pair_numeric, graph_inputs, random_inputs, run
from tvsmt.frontends import generate_pair, write_pair
from tvsmt.frontends.cli_plan import plan as plan_cli
from tvsmt.frontends.mutations import MUTATIONS, NotApplicable, apply
from tvsmt.plan import load_plan, plan_from_dict
from tvsmt.plan.reader import check_pair

TINY_LLAMA = dict(hidden=8, heads=4, ffn=8, vocab=8, seq=3)
SMALL_LLAMA = dict(hidden=16, heads=4, ffn=32, vocab=16, seq=4)
TINY_MLP = dict(hidden=8)


def _grid():
    out = []
    for dp, tp, pp, mb, layers in itertools.product((1, 2, 4), (1, 2, 4), (1, 2, 4), (1, 2, 4),
                                                    (1, 2)):
        if pp <= layers:
            out.append((dp, tp, pp, mb, layers))
    # pp = 4 needs 4 layers
    out += [(1, 1, 4, 1, 4), (2, 2, 4, 2, 4), (1, 4, 4, 4, 4), (4, 1, 4, 2, 5)]
    return out


GRID = _grid()


def _id(cfg):
    dp, tp, pp, mb, layers = cfg
    return f"dp{dp}tp{tp}pp{pp}mb{mb}ly{layers}"


@pytest.mark.parametrize("model", ["mlp", "llama3"])
@pytest.mark.parametrize("cfg", GRID, ids=_id)
def test_lineages_hold_numerically(model, cfg):
    dp, tp, pp, mb, layers = cfg
    dims = TINY_LLAMA if model == "llama3" else TINY_MLP
    single, parallel = generate_pair(model, layers=layers, dp=dp, tp=tp, pp=pp, mb=mb, **dims)
    bad = check_pair_numeric(single, parallel, seed=dp * 1000 + tp * 100 + pp * 10 + mb)
    assert not bad, "\n".join(map(str, bad[:10]))


@pytest.mark.parametrize("model", ["mlp", "llama3"])
def test_plans_are_valid(model):
    dims = SMALL_LLAMA if model == "llama3" else TINY_MLP
    single, parallel = generate_pair(model, layers=2, dp=2, tp=2, pp=2, mb=2, **dims)
    s, p = plan_from_dict(single, "single"), plan_from_dict(parallel, "parallel")
    check_pair(s, p)
    assert s.world["ranks"] == 1 and p.world["ranks"] == 8
    for n in p.nodes:
        assert 0 <= n.rank < 8 and 0 <= n.mb < 2
    # every single output (loss + every weight gradient) has a final lineage of whole
    # tensors covering it, on every rank that holds the weight
    assert s.outputs[0] == "loss" and len(s.outputs) == 1 + sum(
        1 for t in s.tensors.values() if t.role == "param")
    last = {}
    for lin in p.lineages:
        last[lin.single] = lin
    for out in s.outputs:
        lin = last[out]
        assert all(len(part.sum_of) == 1 for part in lin.parts), out
        covered = np.zeros(s.shape(out), dtype=bool)
        for part in lin.parts:
            covered[tuple(slice(a, b) for a, b in part.slice)] = True
        assert covered.all(), out
    # lineages only depend on earlier ones
    for lin in p.lineages:
        if lin.aligned is not None:
            assert all(i < lin.index for i in lin.aligned.inputs)


def test_single_llama_matches_fixture_structure():
    """The single llama3 plan has exactly the reference fixture's operator counts."""
    single, _ = generate_pair("llama3", layers=2, **SMALL_LLAMA)
    counts = {}
    for n in single["nodes"]:
        counts[(n["op"], n["pass"])] = counts.get((n["op"], n["pass"]), 0) + 1
    assert len(single["nodes"]) == 231
    assert counts[("linear", "fw")] == 15 and counts[("multiref", "bw")] == 13
    assert counts[("apply_rotary_emb", "bw")] == 2 and counts[("create_mask", "fw")] == 1


# ----------------------------------------------------------------------------- vs. torch


def _torch_llama(vals, cfg, layers):
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in vals.items()}
    params = {k: v.clone().requires_grad_(True) for k, v in t.items()
              if k.endswith("weight") or ".w" in k}
    b, s = vals["tokens"].shape
    H, nh = cfg["hidden"], cfg["heads"]
    hd = H // nh
    eps = 1e-5

    def norm(x, name):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return x * r * params[f"{name}.weight"]

    def rot(x, f):
        c, sn = torch.cos(f)[None, :, None, :], torch.sin(f)[None, :, None, :]
        a, bb = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * c - bb * sn, a * sn + bb * c], dim=-1).reshape(x.shape)

    mask = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)
    h = params["embed.weight"][t["tokens"].long()]
    for layer in range(layers):
        p = f"L{layer}"
        x = norm(h, f"{p}.attn_norm")
        q = (x @ params[f"{p}.attn.wq"].T).view(b, s, nh, hd)
        k = (x @ params[f"{p}.attn.wk"].T).view(b, s, nh, hd)
        v = (x @ params[f"{p}.attn.wv"].T).view(b, s, nh, hd)
        q, k = rot(q, t[f"{p}.attn.freqs"]), rot(k, t[f"{p}.attn.freqs"])
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        sc = q @ k.transpose(2, 3) / np.sqrt(hd) + mask
        o = (torch.softmax(sc, dim=-1) @ v).transpose(1, 2).reshape(b, s, H)
        h = h + o @ params[f"{p}.attn.wo"].T
        x = norm(h, f"{p}.ffn_norm")
        g = torch.nn.functional.silu(x @ params[f"{p}.ffn.w_gate"].T)
        h = h + (g * (x @ params[f"{p}.ffn.w_up"].T)) @ params[f"{p}.ffn.w_down"].T
    logits = norm(h, "norm") @ params["head.weight"].T
    loss = logits.sum()
    (loss * t["loss.grad"][0]).backward()
    return loss, params


def _torch_mlp(vals, layers):
    params = {f"L{i}.weight": torch.tensor(vals[f"L{i}.weight"], requires_grad=True)
              for i in range(layers)}
    x = torch.tensor(vals["x"])
    for i in range(layers):
        x = x @ params[f"L{i}.weight"].T
    loss = x.sum()
    (loss * torch.tensor(vals["loss.grad"])[0]).backward()
    return loss, params


@pytest.mark.parametrize("model", ["mlp", "llama3"])
def test_single_plan_matches_torch_autograd(model):
    dims = SMALL_LLAMA if model == "llama3" else TINY_MLP
    single, _ = generate_pair(model, layers=2, batch=2, **dims)
    plan = plan_from_dict(single, "single")
    inputs = random_inputs(plan, np.random.default_rng(7))
    vals = run(plan, inputs)
    if model == "llama3":
        loss, params = _torch_llama(inputs, dims, 2)
    else:
        loss, params = _torch_mlp(inputs, 2)
    np.testing.assert_allclose(vals["loss"], [loss.item()], rtol=1e-9, atol=1e-9)
    grads = [o for o in plan.outputs if o != "loss"]
    assert sorted(g[:-len(".grad")] for g in grads) == sorted(params)
    for g in grads:
        ref = params[g[:-len(".grad")]].grad.numpy()
        np.testing.assert_allclose(vals[g], ref, rtol=1e-8, atol=1e-9, err_msg=g)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kw, msg", [
    (dict(model="llama3", tp=3), "heads 4 is not divisible by tp=3"),
    (dict(model="llama3", dp=2, mb=2, batch=6), "batch 6 is not divisible"),
    (dict(model="llama3", pp=3, layers=2), "at least 3 layers"),
    (dict(model="llama3", hidden=64, heads=5), "not divisible by heads"),
    (dict(model="llama3", hidden=12, heads=4), "head_dim 3 must be even"),
    (dict(model="llama3", tp=2, ffn=9, hidden=16), "ffn 9 is not divisible"),
    (dict(model="mlp", hidden=9, tp=2), "hidden 9 is not divisible"),
    (dict(model="gpt"), "unknown model"),
    (dict(model="mlp", dp=0), "dp must be a positive integer"),
])
def test_bad_configs_raise(kw, msg):
    with pytest.raises(ValueError, match=msg):
        generate_pair(**kw)


@pytest.mark.parametrize("model", ["mlp", "llama3", "moe", "deepseek-v3"])
def test_the_size_estimate_bounds_the_generated_plan(model):
    """The refusal of pairs too large to build rests on an upper bound of their nodes: it
    must hold for every model (a generator that grew past it would be refused too late)."""
    from tvsmt.frontends.generator import ModelConfig, World, default_batch, estimated_nodes

    for layers, dp, tp, pp, mb in [(1, 1, 1, 1, 1), (2, 2, 2, 2, 2), (4, 2, 4, 2, 2),
                                   (3, 4, 2, 3, 4)]:
        kw = dict(layers=layers, dp=dp, tp=tp, pp=pp, mb=mb)
        _, parallel = generate_pair(model, **kw)
        cfg = ModelConfig(model, layers, batch=default_batch(dp, mb))
        bound = estimated_nodes(cfg, World(dp, tp, pp, mb))
        assert len(parallel["nodes"]) <= bound, (kw, len(parallel["nodes"]), bound)
        assert len(parallel["nodes"]) * 2 > bound or model == "mlp", (kw, bound)


def test_a_pair_too_large_to_build_is_refused_before_it_is_begun(tmp_path):
    """`--layers 1000000000` once took 15 GB of memory in 15 s before anything stopped it."""
    from tvsmt.frontends.generator import TooLargeToBuild

    with pytest.raises(TooLargeToBuild, match=r"parallel nodes would take about .* GB"):
        generate_pair("llama3", layers=10**9, dp=2, mb=2)
    r = CliRunner().invoke(plan_cli, ["generate", "--layers", "2000", "--dp", "16", "--tp", "8",
                                      "--mb", "8", "--heads", "8", "-o", str(tmp_path / "o")])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "GB free" in r.output and "--format jsonl" in r.output, r.output
    assert not (tmp_path / "o").exists()


def test_write_pair_round_trip(tmp_path):
    s_path, p_path = write_pair(tmp_path, "llama3", dp=2, tp=2, mb=2, **TINY_LLAMA)
    assert os.path.basename(s_path) == "single.json.gz"
    single, parallel = load_plan(s_path), load_plan(p_path)
    check_pair(single, parallel)
    assert parallel.world["dp"] == 2 and parallel.world["model"]["family"] == "llama3"


# ----------------------------------------------------------------------------- bug zoo


@pytest.fixture(scope="module")
def llama_pair():
    return generate_pair("llama3", layers=2, dp=2, tp=2, pp=2, mb=2, **SMALL_LLAMA)


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_breaks_numeric_check(name, llama_pair):
    single, parallel = llama_pair
    try:
        mutated, record = apply(parallel, name, seed=0)
    except NotApplicable:  # e.g. a mixture-of-experts bug in a dense model
        pytest.skip(f"{name} does not fit this plan")
    assert parallel["name"] != mutated["name"]  # the input is not modified
    assert record["bug"] == name and record["nodes"] and record["tensors"]
    ids = {n["id"] for n in mutated["nodes"]}
    if MUTATIONS[name].breaks_graph:
        assert record["target"] not in ids
        plan_from_dict(mutated, "mutated")  # still well formed ...
        with pytest.raises(UndefinedTensor):  # ... but reads a tensor nothing writes
            check_pair_numeric(single, mutated)
        return
    assert set(record["nodes"]) <= ids
    check_pair(plan_from_dict(single, "single"), plan_from_dict(mutated, "mutated"))
    bad = check_pair_numeric(single, mutated)
    assert bad, f"{name} did not change any lineage"


@pytest.mark.parametrize("name", list(MUTATIONS))
@pytest.mark.parametrize("seed", [1, 2])
def test_mutation_other_targets(name, seed, llama_pair):
    single, parallel = llama_pair
    try:
        mutated, record = apply(parallel, name, seed=seed)
    except NotApplicable:  # e.g. a mixture-of-experts bug in a dense model
        pytest.skip(f"{name} does not fit this plan")
    if MUTATIONS[name].breaks_graph:
        with pytest.raises(UndefinedTensor):
            check_pair_numeric(single, mutated)
    else:
        assert check_pair_numeric(single, mutated), record


def test_mutations_on_mlp():
    single, parallel = generate_pair("mlp", layers=4, dp=2, tp=2, pp=2, mb=2, **TINY_MLP)
    applied = 0
    for name, m in MUTATIONS.items():
        try:
            mutated, _ = apply(parallel, name)
        except NotApplicable:
            continue
        applied += 1
        if m.breaks_graph:
            with pytest.raises(UndefinedTensor):
                check_pair_numeric(single, mutated)
        else:
            assert check_pair_numeric(single, mutated), name
    assert applied >= 9


def test_mutation_where_and_not_applicable(llama_pair):
    _, parallel = llama_pair
    target = next(n for n in parallel["nodes"] if n["op"] == "apply_rotary_emb"
                  and n["pass"] == "bw" and n["rank"] == 1)
    _, record = apply(parallel, "swap-bw-outputs", where=target["id"])
    assert record["target"] == target["id"]
    with pytest.raises(NotApplicable):
        apply(parallel, "swap-bw-outputs", where="no-such-node")
    _, flat = generate_pair("llama3", layers=2, **TINY_LLAMA)
    for name in ("drop-bw-reduction", "pp-wrong-stage", "reducer-before-last-accum"):
        with pytest.raises(NotApplicable):
            apply(flat, name)
    with pytest.raises(ValueError, match="unknown bug"):
        apply(parallel, "no-such-bug")


# ----------------------------------------------------------------------------- CLI


def test_cli_generate_mutate_bugs(tmp_path):
    runner = CliRunner()
    out = tmp_path / "pair"
    r = runner.invoke(plan_cli, ["generate", "--model", "llama3", "--hidden", "16", "--ffn",
                                 "32", "--vocab", "16", "--seq", "4", "--dp", "2", "--tp", "2",
                                 "--pp", "2", "--mb", "2", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert (out / "single.json.gz").exists() and (out / "parallel.json.gz").exists()
    bug = tmp_path / "bug"
    r = runner.invoke(plan_cli, ["mutate", str(out), "--bug", "drop-bw-reduction", "-o",
                                 str(bug)])
    assert r.exit_code == 0, r.output
    record = json.loads((bug / "mutation.json").read_text())
    assert record["bug"] == "drop-bw-reduction"
    s, p = load_plan(bug / "single.json.gz"), load_plan(bug / "parallel.json.gz")
    assert check_pair_numeric(s, p)
    r = runner.invoke(plan_cli, ["bugs"])
    assert r.exit_code == 0 and all(name in r.output for name in MUTATIONS)
    r = runner.invoke(plan_cli, ["bugs", "--json"])
    assert {m["name"] for m in json.loads(r.output)} == set(MUTATIONS)


@pytest.mark.parametrize("args, msg", [
    (["generate", "--tp", "3", "-o", "{tmp}/x"], "not divisible by tp=3"),
    (["mutate", "{tmp}/missing", "--bug", "drop-bw-reduction", "-o", "{tmp}/y"],
     "no such file"),
    (["mutate", "{tmp}/flat", "--bug", "drop-bw-reduction", "-o", "{tmp}/y"], "does not apply"),
    (["mutate", "{tmp}/flat", "--bug", "nope", "-o", "{tmp}/y"], "unknown bug"),
    (["mutate", "{tmp}/flat", "--bug", "grad-scale-wrong", "-o", "{tmp}/flat"], "must differ"),
    (["generate", "--model", "gpt", "-o", "{tmp}/x"], "gpt"),
])
def test_cli_errors(tmp_path, args, msg):
    write_pair(tmp_path / "flat", "mlp", **TINY_MLP)
    r = CliRunner().invoke(plan_cli, [a.replace("{tmp}", str(tmp_path)) for a in args])
    assert r.exit_code != 0
    assert msg in r.output and "Traceback" not in r.output
    assert len([ln for ln in r.output.splitlines() if ln.startswith("Error")]) == 1


def test_graph_inputs_helper():
    single, _ = generate_pair("mlp", **TINY_MLP)
    plan = plan_from_dict(single, "s")
    assert set(graph_inputs(plan)) == {"x", "L0.weight", "L1.weight", "loss.grad"}
