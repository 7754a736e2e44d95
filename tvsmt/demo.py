"""`tvsmt demo`: generate, verify, break, verify again — with nothing but the package; then the
same from PyTorch code: a tensor-parallel MLP captured and proven, and the same code with a
bug, caught at its line."""

from __future__ import annotations

import json
import os
import tempfile

from rich.console import Console

from tvsmt.frontends import generate_pair, write_pair_dicts
from tvsmt.frontends.mutations import apply as apply_mutation
from tvsmt.report.render import render
from tvsmt.verify import Options, verify_pair

BUG = "drop-allreduce-keep-dataflow"


def run_demo(out_dir: str | None = None) -> int:
    """Returns 0 when the correct plan is equivalent and the broken one is caught."""
    console = Console()
    with tempfile.TemporaryDirectory(prefix="tvsmt-demo-") as tmp:
        root = out_dir or tmp
        config = dict(layers=2, dp=2, tp=2, pp=2, mb=2)
        console.rule("1. generate a Llama3 plan pair: 2 layers, dp=2 tp=2 pp=2, 2 micro-batches")
        single, parallel = generate_pair("llama3", **config)
        good_dir = os.path.join(root, "llama3-dp2tp2pp2mb2")
        s_path, p_path = write_pair_dicts(good_dir, single, parallel)
        console.print(f"{len(single['nodes'])} single-device nodes, {len(parallel['nodes'])} "
                      f"parallel nodes on {parallel['world']['ranks']} ranks -> {good_dir}")

        console.rule("2. verify it")
        good = verify_pair(s_path, p_path, Options())
        render(good, console)

        console.rule(f"3. inject a real bug ({BUG}) and verify again")
        broken, record = apply_mutation(parallel, BUG)
        bad_dir = os.path.join(root, "llama3-dp2tp2pp2mb2-" + BUG)
        s2, p2 = write_pair_dicts(bad_dir, single, broken)
        with open(os.path.join(bad_dir, "mutation.json"), "w") as f:
            json.dump(record, f, indent=2)
        console.print(f"mutation: {record['description']}; changed "
                      f"{', '.join(record.get('nodes', []))}")
        bad = verify_pair(s2, p2, Options())
        render(bad, console, max_failures=3)
        report_path = os.path.join(bad_dir, "report.json")
        bad.save(report_path)
        if out_dir:
            console.print(f"\nplans and the JSON report are in {root}")
        ok = good.verdict == "equivalent" and bad.verdict == "violation"
        ok = run_capture_demo(console, root) and ok
        console.rule("[green]demo passed[/]" if ok else "[red]demo FAILED[/]")
        return 0 if ok else 1


# A Megatron-style tensor-parallel MLP as a user writes it (examples/megatron_mlp.py is the
# longer version). The bug removes the forward all-reduce of the row-parallel layer.
MLP_SCRIPT = '''\
import torch
import torch.distributed as dist

WORLD_SIZE = 2                       # tensor parallelism 2

class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)           # sum the row-parallel partial outputs
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad

class MLP(torch.nn.Module):
    def __init__(self, ffn, tp=False):
        super().__init__()
        self.tp = tp
        self.fc1 = torch.nn.Linear(8, ffn, bias=False)   # column-parallel
        self.fc2 = torch.nn.Linear(ffn, 8, bias=False)   # row-parallel

    def forward(self, x):
        y = self.fc2(torch.nn.functional.silu(self.fc1(x)))
        return ReduceFromTP.apply(y) if self.tp else y

def build_single():
    return MLP(16), torch.randn(4, 8)

def build_rank(rank):
    full, x = build_single()
    model = MLP(8, tp=True)
    with torch.no_grad():
        model.fc1.weight.copy_(full.fc1.weight[rank * 8:(rank + 1) * 8])
        model.fc2.weight.copy_(full.fc2.weight[:, rank * 8:(rank + 1) * 8])
    return model, x

def train_step(model, x):
    y = model(x)
    loss = (y * y).sum()
    loss.backward()
    return loss
'''
MLP_BUG = ("        dist.all_reduce(x)           # sum the row-parallel partial outputs",
           "        pass                         # bug: the all-reduce is gone")


def run_capture_demo(console: Console, root: str) -> bool:
    """Capture the TP MLP, prove it; capture the buggy copy, show the line it points at.
    True when the first is equivalent and the second a violation naming a line."""
    from rich.syntax import Syntax

    from tvsmt.capture import check

    good_path = os.path.join(root, "tp_mlp.py")
    bad_path = os.path.join(root, "tp_mlp_bug.py")
    bad_text = MLP_SCRIPT.replace(*MLP_BUG)
    for path, text in ((good_path, MLP_SCRIPT), (bad_path, bad_text)):
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    console.rule("4. from PyTorch code: a tensor-parallel MLP (tvsmt check tp_mlp.py)")
    console.print(Syntax(MLP_SCRIPT, "python", line_numbers=True))
    good = check(good_path, Options())
    render(good, console, max_failures=3)
    console.rule("5. the same code with the forward all-reduce removed (tvsmt check "
                 "tp_mlp_bug.py)")
    line = MLP_SCRIPT.splitlines().index(MLP_BUG[0]) + 1
    console.print(Syntax(bad_text, "python", line_numbers=True, line_range=(line - 3, line + 3),
                         highlight_lines={line}))
    bad = check(bad_path, Options())
    render(bad, console, max_failures=1)
    pointed = sorted({n["source"] for f in bad.failures[:1] for n in f.parallel_nodes
                      if n.get("source")})
    if pointed:
        console.print(f"the report points at {', '.join(pointed[-3:])}")
    return good.verdict == "equivalent" and bad.verdict == "violation" and bool(pointed)
