"""The four readings of a plan agree, checked by a differential fuzz.

* The document form is read by the typed fast path (`decode_document`), by the same checks
  on a plan already in memory (`plan_from_object`, the generator's) and by the reference
  validator (`plan_from_dict`), on the same text.
* The JSON Lines form is read record by record (`read_stream`) and in one pass over columns
  (`scan_plan`), on the same records.

Each example damages a valid plan in one to three random places: a value replaced by a
troublemaker, a key dropped, an entry duplicated or swapped, or a name replaced by another
tensor's. Both forms are then written verbatim. Every reading must accept the same plan as
the reference, or refuse it with a one-line input error, and never crash. The one-pass
scan may decline a file it does not take (`NotScanned`), but never one the record-by-record
reading refuses. This fuzz found the JSON Lines readers' missing world checks and a crash on
a tensor named "". The examples are seeded, so a failure names its seed and is reproducible:
`python tests/test_reader_agreement.py SEED` prints the damage.
"""

from __future__ import annotations

import copy
import json
import random
import sys
import uuid
import zlib

import pytest
from handmade import parallel_mlp, single_mlp
from test_scan import assert_scan_reads_the_plan

from tvsmt.errors import TvsmtError
from tvsmt.plan.reader import _ANY, decode_document, plan_from_dict, plan_from_object
from tvsmt.plan.scan import NotScanned, scan_plan
from tvsmt.plan.stream import read_stream

TROUBLE = [None, True, False, 0, 1, -1, 2**53, 2**53 + 1, 2**63, -2**63 - 1, 1.0, 0.5, "", "x",
           "fw", "bw", [], [1], [[0, 1]], {}, {"a": 1}, "t", [None], [1, 2],
           [[0, 2], [0, 2]], 3, 8]
BASES = [lambda: parallel_mlp(dp=2, tp=2), lambda: parallel_mlp(dp=1, tp=2), single_mlp]
SEEDS = range(600)


def _paths(obj, pre=()):
    yield pre
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, pre + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, pre + (i,))


def _damage(plan: dict, rng: random.Random) -> str:
    """One random damage, in place; what it did."""
    where = rng.choice([p for p in _paths(plan) if p])
    parent = plan
    for k in where[:-1]:
        parent = parent[k]
    key = where[-1]
    kind = rng.random()
    if kind < 0.45:
        parent[key] = copy.deepcopy(rng.choice(TROUBLE))
        return f"{where} = {parent[key]!r}"
    if kind < 0.6:
        del parent[key]
        return f"del {where}"
    if kind < 0.75 and parent:
        if isinstance(parent, list):
            parent.insert(rng.randrange(len(parent) + 1), copy.deepcopy(rng.choice(parent)))
        else:
            parent[key] = copy.deepcopy(parent[rng.choice(list(parent))])
        return f"duplicated beside {where}"
    if kind < 0.85 and isinstance(parent, list) and len(parent) > 1:
        i, j = rng.sample(range(len(parent)), 2)
        parent[i], parent[j] = parent[j], parent[i]
        return f"swapped {where[:-1]}[{i}] and [{j}]"
    tensors = plan.get("tensors")
    if isinstance(parent[key], str) and isinstance(tensors, dict) and tensors:
        parent[key] = rng.choice(list(tensors))
        return f"{where} = {parent[key]!r}"
    return "nothing"


def damaged(seed: int) -> tuple[dict, list[str]]:
    rng = random.Random(seed)
    plan = rng.choice(BASES)()
    done = [_damage(plan, rng) for _ in range(rng.choice([1, 1, 2, 3]))]
    return plan, done


def _records(plan: dict) -> list[dict] | None:
    """The plan's JSON Lines records, verbatim (None where the damage left nothing records
    can say: no `tensors` or `nodes` key, which records cannot leave out, or a tensor entry,
    node or lineage that is not an object)."""
    if "tensors" not in plan or "nodes" not in plan:
        return None
    tensors, nodes, lineages = (plan.get(k, d) for k, d in (("tensors", {}), ("nodes", []),
                                                           ("lineages", [])))
    if (not isinstance(tensors, dict) or not isinstance(nodes, list)
            or not isinstance(lineages, list)
            or not all(isinstance(x, dict) for x in (*tensors.values(), *nodes, *lineages))
            or any("r" in x for x in (*tensors.values(), *nodes, *lineages))):
        return None
    head = {k: v for k, v in plan.items() if k not in ("tensors", "nodes", "lineages")}
    return ([{"r": "header", **head, "plan_id": uuid.uuid4().hex, "sections": 0}]
            + [{"r": "tensor", "id": t, **info} for t, info in tensors.items()]
            + [{"r": "node", **n} for n in nodes] + [{"r": "lineage", **x} for x in lineages])


def _write_stream(path, records: list[dict]) -> None:
    lines = [json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records]
    trailer = {"r": "trailer", "plan_id": records[0]["plan_id"], "sections": 0,
               "crc32": zlib.crc32(b"".join(lines))}
    for kind in ("tensor", "node", "lineage"):
        trailer[kind + "s"] = sum(r["r"] == kind for r in records)
    with open(path, "wb") as f:
        f.write(b"".join(lines) + json.dumps(trailer).encode() + b"\n")


def _outcome(read):
    """("plan", the plan) or ("error", its message); an exception that is not an input error
    fails the test (a crash)."""
    try:
        return "plan", read()
    except TvsmtError as e:
        msg = str(e)
        assert len(msg.splitlines()) == 1, msg
        return "error", msg


def _same(a, b, names: bool = True) -> None:
    assert (a.kind, a.world, a.outputs) == (b.kind, b.world, b.outputs)
    assert not names or a.name == b.name
    assert list(a.tensors.items()) == list(b.tensors.items())
    assert len(a.nodes) == len(b.nodes)
    for x, y in zip(a.nodes, b.nodes):
        assert (x, x.attrs, x.source) == (y, y.attrs, y.source)
    assert a.lineages == b.lineages


@pytest.mark.parametrize("chunk", [range(k, k + 100) for k in range(0, len(SEEDS), 100)],
                         ids=lambda r: f"seeds {r.start}-{r.stop - 1}")
def test_every_reading_agrees_with_the_reference(tmp_path, chunk):
    checked = {"document": 0, "stream": 0, "scanned": 0}
    for seed in chunk:
        plan, done = damaged(seed)
        where = f"seed {seed}: {done}"
        try:
            text = json.dumps(plan).encode()
        except ValueError:  # pragma: no cover (the troublemakers are all JSON)
            continue
        try:
            reference = _outcome(lambda: plan_from_dict(_ANY.decode(text), "p"))
        except TvsmtError:
            reference = ("error", "")
        except Exception as e:  # the generic decoder refuses the text (a lone surrogate)
            reference = ("error", str(e))
        for fast in (_outcome(lambda: decode_document(text, "p")),
                     _outcome(lambda: plan_from_object(_ANY.decode(text), "p"))):
            assert fast[0] == reference[0], (where, fast[1] if fast[0] == "error" else "",
                                             reference[1] if reference[0] == "error" else "")
            if fast[0] == "plan":
                _same(fast[1], reference[1])
        checked["document"] += 1
        records = _records(plan) if isinstance(plan, dict) else None
        if records is None:
            continue
        path = str(tmp_path / f"p{seed}.jsonl")
        _write_stream(path, records)
        stream = _outcome(lambda: read_stream(path))
        assert stream[0] == reference[0], (where, stream[1] if stream[0] == "error" else "",
                                           reference[1] if reference[0] == "error" else "")
        if stream[0] == "plan":
            _same(stream[1], reference[1], names="name" in plan)
        checked["stream"] += 1
        try:
            scan_plan(path)
        except NotScanned:
            continue
        except TvsmtError as e:  # what the reading itself meets (a too-long line)
            assert stream[0] == "error", (where, str(e))
            continue
        assert stream[0] == "plan", (where, "scanned a file the records reading refuses",
                                     stream[1])
        assert_scan_reads_the_plan(path)
        checked["scanned"] += 1
    # the fuzz must reach every reading, not only the early refusals
    assert checked["stream"] >= 30 and checked["scanned"] >= 10, checked


if __name__ == "__main__":
    plan, done = damaged(int(sys.argv[1]))
    print(done)
    print(json.dumps(plan)[:2000])


def _shuffled_records(seed: int) -> tuple[list[dict], list[str]]:
    """A valid plan's records (header first) with one to three records moved, copied or
    dropped: damages only the JSON Lines form can have (its order rules); the trailer is
    written to match, so only those rules can refuse them."""
    rng = random.Random(seed)
    records = _records(rng.choice(BASES)())
    done = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        i = rng.randrange(1, len(records))
        kind = rng.random()
        if kind < 0.5:
            j = rng.randrange(1, len(records))
            records.insert(j, records.pop(i))
            done.append(f"moved {i} to {j}")
        elif kind < 0.8:
            records.insert(rng.randrange(1, len(records) + 1), copy.deepcopy(records[i]))
            done.append(f"copied {i}")
        else:
            records.pop(i)
            done.append(f"dropped {i}")
    return records, done


@pytest.mark.parametrize("chunk", [range(k, k + 200) for k in range(0, 600, 200)],
                         ids=lambda r: f"seeds {r.start}-{r.stop - 1}")
def test_the_scan_takes_only_what_the_records_reading_takes(tmp_path, chunk):
    outcomes = {"plan": 0, "error": 0}
    for seed in chunk:
        records, done = _shuffled_records(seed)
        where = f"seed {seed}: {done}"
        path = str(tmp_path / f"p{seed}.jsonl")
        _write_stream(path, records)
        stream = _outcome(lambda: read_stream(path))
        outcomes[stream[0]] += 1
        try:
            scan_plan(path)
        except NotScanned:
            continue
        except TvsmtError as e:
            assert stream[0] == "error", (where, str(e))
            continue
        assert stream[0] == "plan", (where, "scanned a file the records reading refuses",
                                     stream[1])
        assert_scan_reads_the_plan(path)
    assert outcomes["plan"] >= 10 and outcomes["error"] >= 50, outcomes
