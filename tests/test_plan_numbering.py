"""tvsmt/plan/numbering.py: Arrow's numbering of tensor ids is the dict's, exactly.

The Arrow path matches names by hash and then by their bytes: these tests give it names a
byte-blind or prefix-blind match would confuse (a trailing NUL, a longer or shorter name,
another case, non-ASCII text, names Arrow cannot hold) and check every number against the
dict's, undeclared names and absent slots included.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tvsmt import forked as forked_policy
from tvsmt.plan import numbering
from tvsmt.plan.numbering import ABSENT, UNDECLARED, Numbering


@pytest.fixture(params=["dict", "arrow"])
def mode(request, monkeypatch):
    """Every size goes through the dict, or through Arrow (threshold 0)."""
    if request.param == "dict":
        monkeypatch.setenv("TVSMT_NUMBERING", "dict")
    else:
        pytest.importorskip("pyarrow")
        monkeypatch.setattr(numbering, "ARROW_MIN_NAMES", 0)
    return request.param


def _reference(tids, names):
    table = {t: i for i, t in enumerate(tids)}
    return [ABSENT if x is None else table.get(x, UNDECLARED) for x in names]


TIDS = ["t1@r0", "t10@r0", "T1@r0", "t1@r0 ", "\u00e9t\u00e9", "\u65e5\u672c", "a" * 300,
        "", "t2\x00x"]
LOOKALIKES = ["t1@r0\x00", "t1@r", "t1@r00", "t1@R0", "e\u0301t\u00e9", "\u65e5", "a" * 299,
              "a" * 301, "t2", "t2\x00", " ", None]


def test_lookalikes_are_undeclared_and_declared_names_found(mode):
    names = TIDS + LOOKALIKES + TIDS[::-1]
    number = Numbering(list(TIDS))
    assert number.of_names(names).tolist() == _reference(TIDS, names)
    (lens, nums), (lens2, nums2) = number.of_lists([tuple(names[:5]), (), tuple(names[5:])],
                                                   [tuple(names[::-1])])
    assert lens.tolist() == [5, 0, len(names) - 5] and lens2.tolist() == [len(names)]
    assert nums.tolist() == _reference(TIDS, names)
    assert nums2.tolist() == _reference(TIDS, names[::-1])


def test_random_plans_agree_with_the_dict(mode):
    rng = random.Random(7)
    alphabet = "ab@0\u00e9\x00"
    tids = list(dict.fromkeys("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
                              for _ in range(400)))
    column = [tuple(rng.choice(tids) if rng.random() < 0.8 else
                    (None if rng.random() < 0.5 else
                     "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 7))))
                    for _ in range(rng.randint(0, 4))) for _ in range(2000)]
    number = Numbering(tids)
    [(lens, nums)] = number.of_lists(column)
    flat = [x for names in column for x in names]
    assert lens.tolist() == list(map(len, column))
    assert nums.tolist() == _reference(tids, flat)
    assert (nums == UNDECLARED).any() and (nums == ABSENT).any()  # the test covers both


def test_names_arrow_cannot_hold_are_numbered_by_the_dict(mode):
    tids = ["ok", "\ud800lone"]  # a lone surrogate has no UTF-8 form
    number = Numbering(tids)
    names = ["\ud800lone", "ok", "\ud800", None]
    assert number.of_names(names).tolist() == [1, 0, UNDECLARED, ABSENT]
    assert number.of_lists([tuple(names)])[0][1].tolist() == [1, 0, UNDECLARED, ABSENT]


def test_a_missing_list_has_no_length(mode):
    with pytest.raises(TypeError):
        Numbering(["a"]).of_lists([("a",), None])


@pytest.mark.parametrize("names", [TIDS + LOOKALIKES, ["ok", "\ud800lone", None]],
                         ids=["lookalikes", "not-utf-8"])
def test_columns_made_ready_by_arrow_have_the_counted_lengths_and_numbers(mode, names):
    """`NameColumns.by_arrow` (a forked numbering's) reads the lengths off Arrow's offsets:
    the same lengths and numbers as counting and the dict, for empty sequences, absent
    slots, lookalikes and names Arrow cannot hold (then counted and looked up in the
    dict)."""
    tids = list(TIDS) + ["\ud800lone"]
    columns = [[tuple(names[:3]), (), tuple(names[3:]), (None,)], [tuple(names[::-1])], []]
    ready = numbering.NameColumns.by_arrow(columns)
    got = Numbering(tids).of_prepared(ready)
    for column, (lens, nums) in zip(columns, got):
        assert lens.tolist() == list(map(len, column))
        assert nums.tolist() == _reference(tids, [x for seq in column for x in seq])
    with pytest.raises(TypeError):  # an entry that is not a sequence has no length
        numbering.NameColumns.by_arrow([[("a",), None]])


def test_a_few_names_by_key():
    number = Numbering(["x", "y"])
    assert (number["y"], number.get(None), number.get("z", UNDECLARED)) == (1, ABSENT,
                                                                          UNDECLARED)


def test_a_few_names_after_arrow_numbered_many(monkeypatch):
    """Once Arrow numbered the plan, a few names are looked up against its table (no dict
    of the whole table is built)."""
    pytest.importorskip("pyarrow")
    monkeypatch.setattr(numbering, "ARROW_MIN_NAMES", 4)
    number = Numbering(list(TIDS))
    number.of_lists([tuple(TIDS)])
    few = ["t1@r0\x00", TIDS[3], None, TIDS[3], "nope", TIDS[-1]]
    assert number.of_names(few).tolist() == _reference(TIDS, few)
    assert number._table is not None and number._dict is None


def test_the_reader_on_a_real_plan_numbers_as_the_dict(monkeypatch):
    """The reader's columns of a real plan, through Arrow, are the dict's."""
    pytest.importorskip("pyarrow")
    from conftest import fixture_pair

    from tvsmt.plan import load_plan

    _, parallel_path = fixture_pair("llama3-ly2-dp2pp2tp2mb2")
    monkeypatch.setattr(numbering, "ARROW_MIN_NAMES", 0)
    fast = load_plan(parallel_path).columns
    monkeypatch.setenv("TVSMT_NUMBERING", "dict")
    slow = load_plan(parallel_path).columns
    for key in ("in_len", "in_num", "out_len", "out_num", "s_len", "s_num"):
        assert np.array_equal(getattr(fast, key), getattr(slow, key)), key
    assert fast.number._table is not None and slow.number._table is None


# ------------------------------------------------------------------ the forked numbering


@pytest.fixture
def forked(monkeypatch):
    """Every document numbered in a forked child (whatever its size and the load); the
    answers the parent took are recorded."""
    if not hasattr(__import__("os"), "fork"):
        pytest.skip("no fork on this platform")

    monkeypatch.setattr(forked_policy, "PARALLEL", True)
    monkeypatch.setattr(numbering, "FORK_MIN_BYTES", 0)
    taken = []
    result = numbering.ForkedNumbering.result

    def spy(self, lens, n_nodes):
        got = result(self, lens, n_nodes)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(numbering.ForkedNumbering, "result", spy)
    return taken


def _columns(path):
    from tvsmt.plan import load_plan

    cols = load_plan(path).columns
    return [getattr(cols, k) for k in ("in_len", "in_num", "out_len", "out_num", "s_len",
                                       "s_num")]


def _real_parallel():
    from conftest import fixture_pair

    return fixture_pair("llama3-ly2-dp2pp2tp2mb2")[1]


def test_the_forked_numbers_are_the_ones_computed_here(forked, monkeypatch):
    path = _real_parallel()
    got = _columns(path)
    assert forked == [True]  # the child answered and its numbers were taken
    monkeypatch.setattr(numbering, "FORK_MIN_BYTES", 1 << 62)
    monkeypatch.setenv("TVSMT_NUMBERING", "dict")
    assert all(map(np.array_equal, got, _columns(path)))


def _other_document_message(text, *args):
    """A child's answer for another plan's names (the fixture's single plan)."""
    from conftest import fixture_pair
    from tvsmt.plan.reader import open_binary, read_document

    single = fixture_pair("llama3-ly2-dp2pp2tp2mb2")[0]
    with open_binary(single) as f:
        return real_message(read_document(single, f, 1 << 30), *args)


real_message = numbering._numbers_message


@pytest.mark.parametrize("answer", ["fails", "dies", "cut short", "other names", "hangs"])
def test_a_child_that_does_not_answer_for_these_names_leaves_the_numbering_here(
        forked, monkeypatch, answer, tmp_path):
    import os

    ran = tmp_path / "ran"  # the child ran the answer below (not failed before it)

    def fails(text, *args):
        raise MemoryError

    def dies(text, *args):
        os._exit(3)

    def cut_short(text, *args):
        return real_message(text, *args)[:-4]

    def hangs(text, *args):
        import time

        time.sleep(600)

    answers = {"fails": fails, "dies": dies, "cut short": cut_short,
               "other names": _other_document_message, "hangs": hangs}

    def bad(text, *args):
        ran.touch()
        return answers[answer](text, *args)

    monkeypatch.setattr(numbering, "WAIT_SECONDS", 1.0)
    monkeypatch.setattr(numbering, "_numbers_message", bad)
    path = _real_parallel()
    got = _columns(path)
    assert forked == [False] and ran.exists()  # asked, answered so, not taken
    monkeypatch.setattr(numbering, "FORK_MIN_BYTES", 1 << 62)
    monkeypatch.setenv("TVSMT_NUMBERING", "dict")
    assert all(map(np.array_equal, got, _columns(path)))


def test_no_names_build_nothing():
    number = Numbering([str(i) for i in range(10)])
    assert number.of_names([]).tolist() == [] and number._dict is None
    assert number._table is None


def test_arrow_is_imported_meanwhile_only_for_a_document_a_fork_numbers():
    """`arrow_meanwhile`: Arrow imported by a thread (while the caller inflates the text)
    for a document large enough to be numbered by a forked process, so that the fork
    inherits it; for a small one, nothing is imported. A fresh interpreter for each."""
    import os
    import subprocess
    import sys

    if not hasattr(os, "fork") or (os.cpu_count() or 1) < 2:
        pytest.skip("no second core to import Arrow on")
    script = (
        "import sys\n"
        "from tvsmt import forked\n"
        "from tvsmt.plan import numbering\n"
        "forked.PARALLEL = True\n"
        "t = numbering.arrow_meanwhile(int(sys.argv[1]))\n"
        "t is not None and t.join()\n"
        "print(t is not None, 'pyarrow.compute' in sys.modules, bool(numbering._POOL_SET))\n")
    from tvsmt.plan.numbering import FORK_MIN_BYTES

    def run(size: int) -> str:
        return subprocess.run([sys.executable, "-c", script, str(size)], capture_output=True,
                              text=True, check=True).stdout.split()

    assert run(FORK_MIN_BYTES) == ["True", "True", "True"]
    assert run(FORK_MIN_BYTES - 1) == ["False", "False", "False"]
