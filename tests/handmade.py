"""Small hand-written plan pairs for tests: a 2-layer MLP, tensor parallel (Megatron style:
column-parallel then row-parallel with an all-reduce) and data parallel (batch chunks, weight
gradients summed by a reducer). Keyword switches inject one-line bugs."""

from __future__ import annotations

B, D, H = 8, 8, 16  # batch, model dim, hidden


class PlanDict:
    def __init__(self, kind: str, name: str, world: dict):
        self.d = {"format": "tvsmt.execplan", "version": 1, "name": name, "kind": kind,
                  "world": world, "tensors": {}, "nodes": [], "outputs": [], "lineages": []}

    def t(self, tid: str, shape, role="activation") -> str:
        self.d["tensors"][tid] = {"shape": list(shape), "role": role}
        return tid

    def n(self, nid, op, ins, outs, pass_="fw", rank=0, mb=0, **attrs):
        self.d["nodes"].append({"id": nid, "op": op, "pass": pass_, "rank": rank, "mb": mb,
                                "inputs": list(ins), "outputs": list(outs), "attrs": attrs})

    def lineage(self, single, parts, **extra):
        self.d["lineages"].append({"single": single, "parts": [
            {"slice": [list(r) for r in sl], "sum_of": list(ts), **({"scale": sc} if sc else {})}
            for sl, ts, sc in ((p + (None,))[:3] for p in parts)], **extra})


def single_mlp(const: float = 2.0) -> dict:
    p = PlanDict("single", "mlp_single", {"dp": 1, "tp": 1, "pp": 1, "mb": 1, "ranks": 1})
    x, w1, w2 = p.t("x", [B, D], "input"), p.t("w1", [H, D], "param"), p.t("w2", [D, H], "param")
    seed = p.t("seed", [1], "grad")
    for t, s in (("h", [B, H]), ("hs", [B, H]), ("y", [B, D]), ("gy", [B, D]), ("ghs", [B, H]),
                 ("gh", [B, H]), ("gx", [B, D])):
        p.t(t, s)
    p.t("loss", [1], "loss"), p.t("gw1", [H, D], "grad"), p.t("gw2", [D, H], "grad")
    p.n("n1", "linear", [x, w1], ["h"], bias=None)
    p.n("n2", "div", ["h"], ["hs"], consts=[const])
    p.n("n3", "linear", ["hs", w2], ["y"], bias=None)
    p.n("n4", "sum", ["y"], ["loss"])
    p.n("b4", "sum", [seed, "y"], ["gy"], pass_="bw")
    p.n("b3", "linear", ["gy", "hs", w2], ["ghs", "gw2"], pass_="bw", bias=None)
    p.n("b2", "div", ["ghs", "h"], ["gh"], pass_="bw", consts=[const])
    p.n("b1", "linear", ["gh", x, w1], ["gx", "gw1"], pass_="bw", bias=None)
    p.d["outputs"] = ["loss", "gw1", "gw2"]
    return p.d


def parallel_mlp(dp: int = 2, tp: int = 2, drop_allreduce: bool = False,
                 wrong_chunk: bool = False, wrong_const_rank: int | None = None,
                 const: float = 2.0, drop_reducer: bool = False) -> dict:
    """Rank r = d*tp + t. One switch = one-line bug."""
    p = PlanDict("parallel", "mlp_parallel", {"dp": dp, "tp": tp, "pp": 1, "mb": 1,
                                              "ranks": dp * tp})
    b, h = B // dp, H // tp
    ranks = [(d, t, d * tp + t) for d in range(dp) for t in range(tp)]
    tp_group = {d: [d * tp + t for t in range(tp)] for d in range(dp)}
    dp_group = {t: [d * tp + t for d in range(dp)] for t in range(tp)}
    for d, t, r in ranks:
        s = f"@{r}"
        p.t("x" + s, [B, D], "input"), p.t("w1" + s, [h, D], "param")
        p.t("w2" + s, [D, h], "param"), p.t("seed" + s, [1], "grad")
        for name, shape in (("xc", [b, D]), ("h", [b, h]), ("hs", [b, h]), ("yp", [b, D]),
                            ("y", [b, D]), ("loss", [1]), ("gy", [b, D]), ("ghs", [b, h]),
                            ("gh", [b, h]), ("gx", [b, D]), ("lossr", [1])):
            p.t(name + s, shape)
        for name, shape in (("gw1", [h, D]), ("gw2", [D, h]), ("gw1r", [h, D]),
                            ("gw2r", [D, h])):
            p.t(name + s, shape, "grad")
    for d, t, r in ranks:
        s = f"@{r}"
        idx = (d + 1) % dp if (wrong_chunk and r == 0) else d
        p.n("c" + s, "chunk", ["x" + s], ["xc" + s], pass_=None, rank=r, dim=0,
            ranks=list(range(dp)), idx=idx)
        p.n("n1" + s, "linear", ["xc" + s, "w1" + s], ["h" + s], rank=r, bias=None)
        c = 3.0 if wrong_const_rank == r else const
        p.n("n2" + s, "div", ["h" + s], ["hs" + s], rank=r, consts=[c])
        p.n("n3" + s, "linear", ["hs" + s, "w2" + s], ["yp" + s], rank=r, bias=None)
    for d, t, r in ranks:
        s = f"@{r}"
        if drop_allreduce and r == 0:
            p.n("ar" + s, "identity", ["yp" + s], ["y" + s], pass_=None, rank=r)
        else:
            p.n("ar" + s, "all_reduce", [f"yp@{q}" for q in tp_group[d]], ["y" + s],
                pass_=None, rank=r, ranks=tp_group[d])
        p.n("n4" + s, "sum", ["y" + s], ["loss" + s], rank=r)
        p.n("b4" + s, "sum", ["seed" + s, "y" + s], ["gy" + s], pass_="bw", rank=r)
        p.n("b3" + s, "linear", ["gy" + s, "hs" + s, "w2" + s], ["ghs" + s, "gw2" + s],
            pass_="bw", rank=r, bias=None)
        p.n("b2" + s, "div", ["ghs" + s, "h" + s], ["gh" + s], pass_="bw", rank=r, consts=[c])
        p.n("b1" + s, "linear", ["gh" + s, "xc" + s, "w1" + s], ["gx" + s, "gw1" + s],
            pass_="bw", rank=r, bias=None)
    for d, t, r in ranks:
        s = f"@{r}"
        p.n("arl" + s, "all_reduce", [f"loss@{q}" for q in dp_group[t]], ["lossr" + s],
            pass_=None, rank=r, ranks=dp_group[t])
        for w in ("gw1", "gw2"):
            group = dp_group[t]
            ins = [f"{w}@{q}" for q in group] if not (drop_reducer and w == "gw1") else [w + s]
            p.n(f"red_{w}" + s, "reducer", ins, [w + "r" + s], pass_=None, rank=r, ranks=group)

    full = lambda shape: [(0, n) for n in shape]  # noqa: E731
    p.lineage("x", [(full([B, D]), ["x" + f"@{r}"]) for _, _, r in ranks])
    p.lineage("w1", [([(t * h, (t + 1) * h), (0, D)], [f"w1@{r}"]) for d, t, r in ranks])
    p.lineage("w2", [([(0, D), (t * h, (t + 1) * h)], [f"w2@{r}"]) for d, t, r in ranks])
    p.lineage("seed", [([(0, 1)], [f"seed@{r}"]) for _, _, r in ranks])
    rows = lambda d: (d * b, (d + 1) * b)  # noqa: E731
    p.lineage("x", [([rows(d), (0, D)], [f"xc@{r}"]) for d, t, r in ranks])
    for name in ("h", "hs"):
        p.lineage(name, [([rows(d), (t * h, (t + 1) * h)], [f"{name}@{r}"]) for d, t, r in ranks])
    p.lineage("y", [([rows(d), (0, D)], [f"yp@{q}" for q in tp_group[d]]) for d in range(dp)])
    p.lineage("y", [([rows(d), (0, D)], [f"y@{r}"]) for d, t, r in ranks])
    p.lineage("loss", [([(0, 1)], [f"loss@{d * tp + t}" for d in range(dp)]) for t in range(tp)])
    p.lineage("loss", [([(0, 1)], [f"lossr@{r}"]) for _, _, r in ranks])
    p.lineage("gy", [([rows(d), (0, D)], [f"gy@{r}"]) for d, t, r in ranks])
    for name in ("ghs", "gh"):
        p.lineage(name, [([rows(d), (t * h, (t + 1) * h)], [f"{name}@{r}"])
                         for d, t, r in ranks])
    p.lineage("gw2", [([(0, D), (t * h, (t + 1) * h)], [f"gw2@{q}" for q in dp_group[t]])
                      for t in range(tp)])
    p.lineage("gw1", [([(t * h, (t + 1) * h), (0, D)], [f"gw1@{q}" for q in dp_group[t]])
                      for t in range(tp)])
    p.lineage("gw2", [([(0, D), (t * h, (t + 1) * h)], [f"gw2r@{r}"]) for d, t, r in ranks])
    p.lineage("gw1", [([(t * h, (t + 1) * h), (0, D)], [f"gw1r@{r}"]) for d, t, r in ranks])
    return p.d
