#!/usr/bin/env python3
"""Mutation testing of tvsmt's soundness: does the suite notice when the verifier lies?

Each mutation below is a plausible soundness bug in tvsmt's own code, written as text
patches (old -> new) on files of the package. For each one the script copies the project to
a temporary folder, applies the patches there (the checkout is never touched), runs the
tests that should notice, and reports:

    mutation | killed | by which test | seconds

A mutation is *killed* when one of its tests fails. One that provably cannot change
behaviour says why (`equivalent`) and is expected to survive. A patch whose old text is no longer
found exactly once is *stale* (the code it targets has changed: rewrite the patch), never
skipped. The unmutated copy must pass the same tests first (a test that fails anyway kills
nothing; `--no-baseline` leaves that to a caller that runs them itself). The exit code is 0
only when every selected mutation is killed.

    python scripts/mutate.py            # every mutation (a few minutes)
    python scripts/mutate.py --fast     # the CI subset (tests/test_mutation_fast.py)
    python scripts/mutate.py --only reduce-to-one --only drop-last-comparison
    python scripts/mutate.py --list     # the mutations, their files and tests
    python scripts/mutate.py --markdown # the table as markdown
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("tvsmt", "tests", "examples", "pyproject.toml")


@dataclass(frozen=True)
class Patch:
    file: str  # relative to the project root
    old: str
    new: str


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    shortcut: str  # what it attacks (the README's table "Shortcuts and their guards")
    patches: tuple[Patch, ...]
    tests: tuple[str, ...]  # pytest node ids or files; one must fail
    fast: bool = False  # part of the CI subset
    # A mutation that cannot change behaviour, with the reason; it is run, and surviving is
    # then its expected outcome ("equivalent"), never a silent pass of a real one.
    equivalent: str = ""


T_SINGLE = "tests/test_single_element.py::test_one_wrong_element_is_a_violation_naming_it"
T_E2E = "tests/test_shape_reduction_e2e.py"
T_ORCH = "tests/test_orchestration.py"
T_FOLD = "tests/test_fold.py::test_bug_in_a_folded_away_unit_is_caught"

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "drop-last-comparison",
        'the "some element differs" disjunction drops its last comparison',
        "encoding",
        (Patch("tvsmt/encoding/smtlib.py",
               '        diffs.append(f"(not (= l{i} r{i}))")\n',
               '        if i < len(distinct) - 1:\n'
               '            diffs.append(f"(not (= l{i} r{i}))")\n'),),
        (f"{T_SINGLE}[elementwise-last]", f"{T_SINGLE}[contraction-last]"), fast=True),
    Mutation(
        "pairs-deduplicated-by-single-side",
        "identical comparisons are stated once, but pairs are taken as identical when their "
        "single sides are: a wrong copy among replicated ones is dropped",
        "encoding",
        (Patch("tvsmt/encoding/smtlib.py",
               "    distinct = list(dict.fromkeys(pairs))\n",
               "    distinct = list({l: (l, r) for l, r in reversed(pairs)}.values())[::-1]\n"),
         Patch("tvsmt/encoding/smtlib.py",
               "    pair_names = [named[pair] for pair in pairs]\n",
               "    pair_names = [named.get(pair, ('l0', 'r0')) for pair in pairs]\n")),
        ("tests/test_encoding.py::"
         "test_a_wrong_copy_among_replicated_copies_is_caught_at_its_rank",), fast=True),
    Mutation(
        "repeated-pairs-named-as-the-first",
        "every comparison is given the first pair's names, so a model's mismatch is "
        "reported at the wrong element",
        "encoding",
        (Patch("tvsmt/encoding/smtlib.py",
               "    pair_names = [named[pair] for pair in pairs]\n",
               "    pair_names = [next(iter(named.values())) for pair in pairs]\n"),),
        ("tests/test_encoding.py::"
         "test_a_wrong_copy_among_replicated_copies_is_caught_at_its_rank",)),
    Mutation(
        "fork-sigterm-not-blocked",
        "SIGTERM is not blocked across a fork, so one that reaches a pool's new worker "
        "while it is set up is taken by the command's handler and the pool waits for ever",
        "process hygiene",
        (Patch("tvsmt/solving/lifeline.py",
               "    if _TERM and _state[\"active\"]:\n",
               "    if False:\n"),),
        ("tests/test_lifeline.py::"
         "test_a_sigterm_that_reaches_a_forked_worker_during_its_fork_ends_it",), fast=True),
    Mutation(
        "skip-last-element",
        "the element loop skips the last element of every target part (off by one)",
        "encoding",
        (Patch("tvsmt/encoding/stage.py",
               "        for idx in itertools.product(*(range(n) for n in view.shape)):\n"
               "            terms = [a[idx] for a in parrs]\n",
               "        for idx in list(itertools.product(*(range(n) for n in view.shape)))[:-1]:\n"
               "            terms = [a[idx] for a in parrs]\n"),),
        (f"{T_SINGLE}[elementwise-interior]",), fast=True),
    Mutation(
        "term-identity-printed",
        "the term-identity fast path compares printed terms (pysmt's str truncates deep "
        "terms) instead of the hash-consed terms",
        "term identity",
        (Patch("tvsmt/encoding/stage.py", "            if lhs is rhs:\n",
               "            if str(lhs) == str(rhs):\n"),),
        (f"{T_SINGLE}[deep-elementwise-interior]",), fast=True),
    Mutation(
        "dedup-ignores-constants",
        "canonical deduplication names an obligation by a digest that ignores its numbers, "
        "so obligations that differ in a constant are solved once",
        "canonical dedup",
        (Patch("tvsmt/encoding/smtlib.py",
               "return Printed(text, hashlib.sha256(text.encode()).hexdigest(), symbols, "
               "pair_names)",
               "return Printed(text, hashlib.sha256(text.translate(str.maketrans('', '', "
               "'0123456789')).encode()).hexdigest(), symbols, pair_names)"),),
        ("tests/test_shortcut_guards.py::"
         "test_obligations_that_differ_in_a_constant_are_solved_apart",), fast=True),
    Mutation(
        "reduce-to-one",
        "shape reduction lets a dimension shrink to 1",
        "shape reduction",
        (Patch("tvsmt/shapes/dims.py",
               "lo = max(self.min_size.get(m, 1), min(2, dim.n))",
               "lo = max(self.min_size.get(m, 1), 1)"),),
        (T_E2E,), fast=True),
    Mutation(
        "forget-slice-starts",
        "shape reduction forgets the start boundaries of lineage slices",
        "shape reduction",
        (Patch("tvsmt/shapes/reduce.py",
               "                solver.keep_divisible(sdims[i], s)\n", ""),),
        ("tests/test_single_element.py", T_E2E, "tests/test_encoding.py"),
        equivalent="a part's width (e - s) is kept divisible by the part's size constraint "
                   "(p * n == S * (e - s)) and its end e by keep_divisible, so its start "
                   "s = e - (e - s) is divisible too"),
    Mutation(
        "lineage-dims-not-united",
        "shape reduction forgets that a lineage part's dimensions are its single tensor's "
        "(the same divisor), so a part may be reduced apart from the slice it holds",
        "shape reduction",
        (Patch("tvsmt/shapes/reduce.py", "                        solver.same(pdim, sdims[i])\n",
               "                        pass\n"),),
        ("tests/test_shape_reduction_e2e.py", "tests/test_encoding.py"), fast=True),
    Mutation(
        "forget-slice-boundaries",
        "shape reduction forgets every lineage slice boundary (start and end)",
        "shape reduction",
        (Patch("tvsmt/shapes/reduce.py",
               "                solver.keep_divisible(sdims[i], s)\n"
               "                solver.keep_divisible(sdims[i], e)\n", ""),),
        ("tests/test_single_element.py::test_an_off_by_one_slice_is_a_violation",), fast=True),
    Mutation(
        "signature-ignores-attrs",
        "the stage-template signature ignores node attributes",
        "stage templates",
        (Patch("tvsmt/stages/signature.py",
               "                          attrs_key(n.attrs if reads is None else reads(n.attrs)),",
               '                          "",'),),
        ("tests/test_shortcuts.py",), fast=True),
    Mutation(
        "attrs-key-names-only",
        "the attributes key holds the attributes' names, not their values (stage templates "
        "and the shape-rule checks merge nodes that differ in an attribute)",
        "stage templates",
        (Patch("tvsmt/ops/registry.py", '    return ("repr", repr(attrs))',
               '    return ("repr", repr(sorted(attrs) if type(attrs) is dict else attrs))'),),
        ("tests/test_shortcuts.py", "tests/test_signature.py"), fast=True),
    Mutation(
        "shape-checks-key-forgets-outputs",
        "the shape-rule checks judge a node by an identical earlier one without comparing "
        "output shapes",
        "shape-rule checks (one evaluation per distinct node)",
        (Patch("tvsmt/lineage/checks.py",
               "        key = (node.op, node.pass_, in_shapes, out_shapes, attrs_key(node.attrs))",
               "        key = (node.op, node.pass_, in_shapes, attrs_key(node.attrs))"),),
        ("tests/test_signature.py::test_a_bad_node_beside_identical_good_ones_is_flagged",),
        fast=True),
    Mutation(
        "signature-form-without-disjointness",
        "a stage signature puts every lineage in its own form, also when some of its tensors "
        "were already numbered in the stage",
        "stage templates",
        (Patch("tvsmt/stages/signature.py",
               "        if p_seen.keys().isdisjoint(tensors):",
               "        if True:"),),
        ("tests/test_signature.py::"
         "test_signatures_split_stages_as_the_tensor_by_tensor_numbering_does",), fast=True),
    Mutation(
        "signature-ignores-slices",
        "the stage-template signature ignores lineage slices",
        "stage templates",
        (Patch("tvsmt/stages/signature.py",
               "            form = tuple((p.slice, tuple(",
               "            form = tuple(((), tuple("),
         Patch("tvsmt/stages/signature.py",
               "                (p.slice, tuple([tid(1, t) for t in p.sum_of]), _ratio(p.scale))",
               "                ((), tuple([tid(1, t) for t in p.sum_of]), _ratio(p.scale))")),
        ("tests/test_shortcut_guards.py::"
         "test_swapped_slices_in_one_of_two_identical_layers_are_a_violation",), fast=True),
    Mutation(
        "non-sat-is-proven",
        "any answer but sat counts as proven (timeout, unknown, error)",
        "solving",
        (Patch("tvsmt/policy.py", "    if res.status == UNSAT:\n        ev = out.evaluation",
               "    if res.status != SAT:\n        ev = out.evaluation"),),
        (f"{T_ORCH}::test_solver_timeout_is_inconclusive_never_a_pass",
         f"{T_ORCH}::test_without_a_solver_answer_evaluation_still_finds_a_real_bug"),
        fast=True),
    Mutation(
        "inconclusive-ignored",
        "inconclusive failures do not change the verdict",
        "solving",
        (Patch("tvsmt/policy.py",
               "    elif failures or not solved:\n        report.verdict = INCONCLUSIVE\n",
               "    elif not solved:\n        report.verdict = INCONCLUSIVE\n"),),
        (f"{T_ORCH}::test_solver_timeout_is_inconclusive_never_a_pass",), fast=True),
    Mutation(
        "crosscheck-one-sided",
        "crosscheck accepts one solver's unsat when the other timed out or gave up",
        "solving",
        (Patch("tvsmt/policy.py",
               "if res.status == UNSAT and any(d.status != UNSAT for d in res.details):",
               "if res.status == UNSAT and any(d.status == SAT for d in res.details):"),),
        (f"{T_ORCH}::test_crosscheck_never_passes_on_one_solver_alone",
         f"{T_ORCH}::test_crosscheck_policy_pass_needs_every_solver_counterexample_stands_alone"),
        fast=True),
    Mutation(
        "refuted-budget-everywhere",
        "every obligation gets the short solver budget of one already refuted at concrete "
        "points (proofs cut short: inconclusive, never a pass, but not the policy)",
        "solving",
        (Patch("tvsmt/solving/dispatch.py",
               "        own = budget if ob.digest in refuted else None",
               "        own = budget"),),
        (f"{T_ORCH}::test_an_obligation_refuted_at_concrete_points_gets_a_short_solver_budget",)),
    Mutation(
        "solver-budget-ignored",
        "the solver runner ignores an obligation's own budget and gives it the run's timeout",
        "solving",
        (Patch("tvsmt/solving/runner.py",
               "limit = self.limit(timeout_s)",
               "limit = self.limit(None)"),),
        (f"{T_ORCH}::test_an_obligation_refuted_at_concrete_points_gets_a_short_solver_budget",
         "tests/test_solving.py::test_a_budget_limits_its_obligation_only_in_the_same_run")),
    Mutation(
        "pinned-functions-free",
        "a refuted obligation is asked at its point with only its inputs fixed, its "
        "uninterpreted functions left free (a nonlinear query again)",
        "solving",
        (Patch("tvsmt/encoding/smtlib.py",
               "             for (name, args), v in applications.items()]",
               "             for (name, args), v in applications.items() if False]"),),
        ("tests/test_capture_dtensor.py::"
         "test_a_refuted_obligation_is_confirmed_at_its_point_where_the_whole_one_times_out",)),
    Mutation(
        "exact-point-from-floats",
        "the inputs the assumptions determine keep the float point's values (which satisfy "
        "the assumptions only up to rounding) instead of being computed exactly",
        "solving",
        (Patch("tvsmt/encoding/concrete.py",
               "            exact[p] = sum(",
               "            exact[p] = Fraction(point[p]) or sum("),),
        ("tests/test_encoding.py::"
         "test_a_refuting_point_made_exact_keeps_the_assumptions_and_the_difference",)),
    Mutation(
        "refuted-budget-timeout-recorded",
        "a timeout at the short budget is recorded in the corpus as the solver's answer (cut "
        "short on purpose, it says nothing of the obligation)",
        "caching",
        (Patch("tvsmt/solving/dispatch.py",
               "if not (cut_short and raw.status == TIMEOUT):",
               "if True:"),),
        (f"{T_ORCH}::test_an_obligation_refuted_at_concrete_points_gets_a_short_solver_budget",)),
    Mutation(
        "evaluation-ignored",
        "belt and braces off: an unsat is trusted although a concrete point contradicts it",
        "solving",
        (Patch("tvsmt/policy.py",
               "        if ev is None or ev.counterexample is None:\n            return None\n",
               "        return None\n"),),
        ("tests/test_verdicts.py::test_a_lying_solver_cannot_pass_a_buggy_plan",
         f"{T_ORCH}::test_a_lying_solver_never_makes_a_buggy_plan_pass"), fast=True),
    Mutation(
        "evaluation-rows-misaligned",
        "the random evaluation's (comparison x point) arrays compare each single value with "
        "the next comparison's parallel value",
        "solving",
        (Patch("tvsmt/encoding/concrete.py",
               "    differ = finite & ~near\n",
               "    differ = finite & ~near\n"
               "    par = np.roll(par, 1, axis=0)\n"
               "    differ = np.isfinite(single) & np.isfinite(par) & (single != par)\n"),),
        ("tests/test_encoding_cost.py::"
         "test_random_evaluation_finds_what_the_element_by_element_check_finds",), fast=True),
    Mutation(
        "hypotheses-trusted",
        "inferred lineages are trusted: a failing hypothesis is ignored instead of dropped",
        "inferred lineages",
        (Patch("tvsmt/capture/driver.py",
               "            bad = hypotheses_to_drop(single, parallel, report, witnessed)\n"
               "            if not bad:\n",
               "            bad = hypotheses_to_drop(single, parallel, report, witnessed)\n"
               "            if bad:\n"
               "                from tvsmt.policy import decide\n"
               "                decide(report, [f for f in report.failures\n"
               "                                if f.lineage not in bad])\n"
               "                bad = set()\n"
               "            if not bad:\n"),),
        ("tests/test_capture.py::test_a_wrong_hypothesis_never_turns_into_a_pass",),
        fast=True),
    Mutation(
        "witness-ignored-when-proven",
        "a claim the concrete run contradicts passes when the solver proves it",
        "inferred lineages",
        (Patch("tvsmt/capture/driver.py",
               "    if missed and report.verdict == EQUIVALENT:\n",
               "    if False:\n"),),
        ("tests/test_capture_llama.py::"
         "test_a_witnessed_claim_that_the_solver_proves_is_never_a_pass",)),
    Mutation(
        "cache-previous-hash",
        "a cached verdict is looked up under the stage's previous obligation hash",
        "caching",
        (Patch("tvsmt/solving/dispatch.py",
               "    if corpus is not None:\n"
               "        store_in_corpus(corpus, unique, outcomes, parallel, pinned)\n",
               "    from tvsmt.solving.corpus import pair_key\n"
               "    previous = (dict(corpus.pairs.get(pair_key(parallel.path), {}))\n"
               "                if corpus is not None else {})\n"
               "    if corpus is not None:\n"
               "        store_in_corpus(corpus, unique, outcomes, parallel, pinned)\n"),
         Patch("tvsmt/solving/dispatch.py",
               "                   else _trusted_verdict(corpus, trust, dg, refused))",
               "                   else _trusted_verdict(corpus, trust,\n"
               "                                         previous.get(ob.meta['stage'], dg),\n"
               "                                         refused))")),
        ("tests/test_shortcut_guards.py::test_a_corpus_never_answers_for_another_obligation",),
        fast=True),
    Mutation(
        "corpus-trusts-edited-file",
        "the corpus trusts an obligation file whose content no longer matches its hash",
        "caching",
        (Patch("tvsmt/solving/corpus.py", "            if actual != name:\n",
               "            if False:\n"),
         Patch("tvsmt/solving/corpus.py",
               "        if check and digest_of(body) != digest:\n",
               "        if False:\n")),
        (f"{T_ORCH}::test_corpus_incremental_fresh_and_replay",), fast=True),
    # Folding: tvsmt/fold is being rewritten (helper "fold"); these patches may go stale.
    Mutation(
        "fold-ignores-attrs",
        "the fold's copy check ignores node attributes",
        "folding",
        (Patch("tvsmt/fold/folder.py", '"n_mb": mb, "n_attrs": tab.n_attrs,', '"n_mb": mb,'),),
        (f"{T_FOLD}[wrong-constant-one-rank]",)),
    Mutation(
        "fold-ignores-inputs",
        "the fold's copy check ignores node inputs",
        "folding",
        (Patch("tvsmt/fold/folder.py", '"n_in": ins, "n_in_ptr": in_ptr, ', ""),),
        (f"{T_FOLD}[bw-wrong-input]",)),
    Mutation(
        "fold-drops-exception",
        "the fold drops the last unit that is not a copy (an exception)",
        "folding",
        (Patch("tvsmt/fold/folder.py",
               "replicas = set(self.kept_d) | {u[0] for u in self.exceptions}",
               "replicas = set(self.kept_d) | {u[0] for u in self.exceptions[:-1]}"),
         Patch("tvsmt/fold/folder.py", "units |= set(self.exceptions)",
               "units |= set(self.exceptions[:-1])")),
        (f"{T_FOLD}[grad-scale-wrong]",), fast=True),
    Mutation(
        "fold-finishes-unchecked",
        "the folded pair is built although some units were never compared with their "
        "representative (a chunk of the workers' answers lost)",
        "folding",
        (Patch("tvsmt/fold/source.py", "    if unchecked:\n", "    if False:\n"),),
        ("tests/test_stream.py::test_units_no_worker_answered_for_are_never_folded_away",),
        fast=True),
    Mutation(
        "fold-forgets-worker-marks",
        "the parallel fold forgets which lineages its workers saw unmoved before their batch "
        "dimension was known, so a unit re-checked afterwards may learn one they contradict",
        "folding",
        (Patch("tvsmt/fold/source.py", "        checker.nodiff_undecided[undecided] = True\n",
               "        pass\n"),),
        ("tests/test_stream.py::test_units_are_checked_by_the_workers_and_fold_as_serially",
         "tests/test_stream.py::test_a_bug_in_a_unit_checked_by_a_worker_is_caught"),
        equivalent="argued unreachable, not proven: a kept instance unit found a copy has "
                   "decided or marked every lineage of the representative (every copy holds "
                   "the same lineages), so a worker can only mark what the main process "
                   "already did. If none is a copy, the one exception that decides "
                   "lineages (two parts of one lineage moved along different dimensions) is "
                   "refused by Folder.exception_piece (its parts give different pieces), and "
                   "without decided lineages a worker accepts only units that move nothing, "
                   "which hold no piece and fail the tiling check. Tried 2026-12-05: a "
                   "streamed plan built to reach it was refused by exception_piece first"),
    Mutation(
        "fold-columns-trust-stale",
        "the column-wise split of a loaded plan uses the reader's columns without checking "
        "that the plan still holds the nodes they were read from, so a node replaced after "
        "reading (a bug in a unit the fold drops) is never compared",
        "folding (reader columns)",
        (Patch("tvsmt/fold/columns.py",
               "            and ((cols.nodes is plan.nodes and isinstance(plan.nodes, "
               "LazySequence))  # immutable\n"
               "                 or all(map(is_, cols.nodes, plan.nodes))) and cols.tids == ",
               "            and cols.tids == "),),
        ("tests/test_fold_columns.py::test_stale_reader_columns_are_not_used",
         "tests/test_fold_columns.py::test_a_bug_put_into_a_loaded_real_plan_in_place_is_caught"),
        fast=True),
    Mutation(
        "forked-split-unchecked",
        "the fold takes the split the reader's forked numbering computed without checking "
        "that it was computed from the fold's own inputs (its digest), so a split of other "
        "ranks, ops or tensors decides the units",
        "folding (the split computed by the forked reader, fold/split.py)",
        (Patch("tvsmt/fold/columns.py",
               "    return split if split.digest == digest else None",
               "    return split"),),
        ("tests/test_fold_columns.py::test_a_forked_split_of_other_inputs_is_not_used",),
        fast=True),
    Mutation(
        "arrow-name-lengths-shifted",
        "the forked numbering reads each sequence's length off Arrow's list offsets one "
        "entry off, so names are attributed to the wrong nodes",
        "the reader's tensor numbering (numbering.NameColumns.by_arrow)",
        (Patch("tvsmt/plan/numbering.py",
               "        self.lens = [np.diff(a.offsets.to_numpy()) for a in lists]",
               "        self.lens = [np.roll(np.diff(a.offsets.to_numpy()), 1) for a in lists]"),),
        ("tests/test_plan_numbering.py::"
         "test_columns_made_ready_by_arrow_have_the_counted_lengths_and_numbers",),
        fast=True),
    Mutation(
        "fold-answer-one-scale",
        "the folded pair's lineage scales, parsed once per distinct text, are all given "
        "the first one parsed, so a part comes back from the forked fold with another scale",
        "the fold in a forked process (fold_child._FoldAnswer)",
        (Patch("tvsmt/fold_child.py",
               "                got = parsed.get(obj)",
               "                got = next(iter(parsed.values()), None)"),),
        ("tests/test_fold_in_child.py::test_every_lineage_part_comes_back_with_its_own_scale",),
        fast=True),
    Mutation(
        "lazy-parts-tensor-twice",
        "lineage parts read as columns for the fold no longer refuse a part that names one "
        "tensor twice, so the part claims twice the tensor's value",
        "the reader's lineage parts as columns (reader._lazy_lineages)",
        (Patch("tvsmt/plan/reader.py",
               "        if len(np.unique(pair)) != len(pair):",
               "        if False:"),),
        ("tests/test_plan_reader.py::test_lineage_parts_read_as_columns_agree_with_the_"
         "reference",),
        fast=True),
    Mutation(
        "slice-texts-first-slice",
        "lineage slices kept as text (parts read as columns for the fold, the JSON Lines "
        "scan) all decode to the first distinct text's slice, so a part claims another "
        "region of its single tensor",
        "lineage slices decoded once per text (reader.decode_slice_texts)",
        (Patch("tvsmt/plan/reader.py",
               "        index.append(by_value.setdefault(key, len(by_value)))",
               "        index.append(0)"),),
        ("tests/test_plan_reader.py::test_lineage_parts_read_as_columns_agree_with_the_"
         "reference",),
        fast=True),
    Mutation(
        "lazy-parts-scale-one",
        "lineage parts read as columns for the fold lose their scales (each distinct scale "
        "read as 1), so a partial sum claims to be the whole value",
        "the reader's lineage parts as columns (reader._lazy_lineages)",
        (Patch("tvsmt/plan/reader.py",
               "                scales.append(decode_scale(Fraction, None if sc is None else "
               "list(sc)))",
               "                scales.append(_ONE)"),),
        ("tests/test_plan_reader.py::test_lineage_parts_read_as_columns_agree_with_the_"
         "reference",),
        fast=True),
    Mutation(
        "fold-attrs-before-split-misaligned",
        "the attribute columns computed for every node before the forked split arrives are "
        "taken for the first nodes instead of the kept ones, so a unit's nodes are compared "
        "with other nodes' attributes",
        "folding (column split)",
        (Patch("tvsmt/fold/columns.py",
               "            self._attrs, self._attr_ptr = codes[self._keep], _ptr(al)",
               "            self._attrs, self._attr_ptr = codes[:len(self._keep)], _ptr(al)"),),
        ("tests/test_fold_real.py::test_a_real_plan_read_for_the_fold_folds_as_when_read_whole",)),
    Mutation(
        "fold-columns-input-unit",
        "the column-wise split gives a graph input read by several units the unit of the "
        "first reader (not the replica unit or none), so units are compared through wrong "
        "references",
        "folding (column split)",
        (Patch("tvsmt/fold/split.py",
               "tunit[t] = np.where(lo == hi, lo, np.where(",
               "tunit[t] = np.where(True, lo, np.where("),),
        ("tests/test_fold_columns.py",)),
    Mutation(
        "memo-ignores-input-terms",
        "the symbolic node memo keys a node's result by the node alone, not by its input "
        "terms, so a node run on other terms in another stage reuses stale results",
        "node memo (encoding)",
        (Patch("tvsmt/encoding/interpreter.py",
               "            tuple(None if a is None else (a.shape, tuple(map(id, a.flat))) "
               "for a in ins))",
               "            ())"),),
        ("tests/test_encoding_cost.py::"
         "test_a_node_run_on_other_input_terms_is_not_served_from_the_memo",
         "tests/test_encoding_cost.py::test_node_memo_gives_byte_identical_obligations",
         "tests/test_encoding_cost.py::test_a_bug_in_a_memoised_multi_output_node_is_still_caught"),
        fast=True),
    Mutation(
        "entry-copy-defined-twice",
        "a parallel entry tensor defined by one lineage part stays marked undefined, so a "
        "second part that names it (the same tensor claimed twice) overwrites its "
        "definition instead of constraining it",
        "term-identity fast path (encoding)",
        (Patch("tvsmt/encoding/stage.py",
               "                untouched.discard(part.sum_of[0])\n", ""),),
        ("tests/test_encoding.py",),
        fast=True),
    Mutation(
        "target-copy-not-compared",
        "a target part that is one tensor with scale 1 is taken as equal by construction "
        "without looking at its terms",
        "term-identity fast path (encoding)",
        (Patch("tvsmt/encoding/stage.py",
               "and all(\n                map(operator.is_, view.flat,",
               "and any(\n                map(operator.is_, view.flat,"),),
        (T_SINGLE, "tests/test_encoding.py"),
        fast=True),
    Mutation(
        "memo-ignores-attributes",
        "the symbolic node memo keys a node's result by its operator and input terms but not "
        "its attributes, so a rank whose replicated norm has another epsilon reuses the "
        "first rank's result",
        "node memo (encoding)",
        (Patch("tvsmt/encoding/interpreter.py",
               "attrs_key(node.attrs if reads is None else reads(node.attrs)),",
               "(),"),),
        ("tests/test_encoding_cost.py::"
         "test_nodes_with_other_attributes_on_the_same_terms_are_not_served_from_the_memo",
         "tests/test_encoding_cost.py::test_a_wrong_constant_on_one_tensor_parallel_rank_is_caught"),
        fast=True),
    Mutation(
        "unjudged-stages-pass",
        "the verdict policy says equivalent when no failure was found, although some stages "
        "were never judged (an outcome lost between the encoding and the judging)",
        "verdict policy",
        (Patch("tvsmt/policy.py", "    if solved and not failures and unjudged:\n",
               "    if False:\n"),),
        ("tests/test_verdicts.py::test_a_stage_never_judged_is_never_a_pass",
         "tests/test_verdicts.py::"
         "test_a_verification_that_loses_a_stage_s_outcome_is_inconclusive"), fast=True),
    Mutation(
        "semantic-key-drops-piece-index",
        "the semantic key of chunk, reduce-scatter and all-to-all (what their rules read) "
        "leaves out the piece index, so two ranks' different pieces look like one computation "
        "to the stage templates, the node memo and the fold",
        "operator semantic keys",
        (Patch("tvsmt/ops/definitions/comm.py",
               '            "idx": attrs.get("idx"), "pieces": len(attrs.get("ranks") or ())}',
               '            "pieces": len(attrs.get("ranks") or ())}'),),
        ("tests/test_ops_torch.py::test_attributes_outside_the_semantic_key_change_nothing",),
        fast=True),
    Mutation(
        "broadcast-source-by-rank-order",
        "a broadcast with several inputs takes the source's place among the group's ranks "
        "sorted, not in the group's order: a renaming of the ranks (the fold's, onto the "
        "representative unit) may then pick another input",
        "operator semantic keys",
        (Patch("tvsmt/ops/definitions/comm.py",
               '        x = ins[list(attrs["ranks"]).index(attrs["src"])]',
               '        x = ins[sorted(attrs["ranks"]).index(attrs["src"])]'),),
        ("tests/test_ops_torch.py::test_rank_attributes_renamed_one_to_one_change_nothing",),
        fast=True),
    Mutation(
        "sum-writes-into-its-input",
        "the sum of a group (all-reduce, reducer, gradient accumulation) writes its result "
        "into its first input's array, which other readers of that tensor and the node "
        "memo's kept inputs share",
        "node memo (encoding)",
        (Patch("tvsmt/ops/definitions/comm.py",
               "def sum_fw(be, ins, attrs, ctx):\n    return [add_all(present(ins))]\n",
               "def sum_fw(be, ins, attrs, ctx):\n    xs = present(ins)\n"
               "    total = add_all(xs)\n    xs[0][...] = total\n    return [total]\n"),),
        ("tests/test_ops_torch.py::test_rules_leave_their_input_arrays_as_they_were",),
        fast=True),
    Mutation(
        "sum-fresh-symbol-per-call",
        "the symbolic sum of a group adds a fresh symbol each time it runs, so two nodes the "
        "node memo takes for one computation would be given one node's fresh terms",
        "node memo (encoding)",
        (Patch("tvsmt/ops/definitions/comm.py",
               "def sum_fw(be, ins, attrs, ctx):\n    return [add_all(present(ins))]\n",
               "def sum_fw(be, ins, attrs, ctx):\n    out = add_all(present(ins))\n"
               "    if getattr(be, 'symbolic', False):\n"
               "        out = np.vectorize(lambda t: be.mgr.Plus(t, be.mgr.FreshSymbol("
               "be.real)), otypes=[object])(out)\n    return [out]\n"),),
        ("tests/test_ops_torch.py::"
         "test_symbolic_rules_give_the_very_same_terms_on_the_same_inputs",), fast=True),
    Mutation(
        "constant-input-values-unchecked",
        "a constant rank input placed by Megatron-Core's tensor-parallel rank (or as the only "
        "block of its shape) is taken without comparing its values with that block",
        "capture's input lineages (constant tensors)",
        (Patch("tvsmt/capture/lineages.py",
               "    if not all(held(_view(s, block), r) for s, r in zip(single.draws, "
               "mine.draws)):\n",
               "    if False:\n"),),
        ("tests/test_capture_megatron_core.py::"
         "test_a_constant_shard_is_refused_unless_megatron_places_it",), fast=True),
    Mutation(
        "constant-input-first-block",
        "a constant rank input that matches several blocks is taken as the first one instead "
        "of refused",
        "capture's input lineages (constant tensors)",
        (Patch("tvsmt/capture/lineages.py",
               "    elif len(candidates) == 1:\n",
               "    elif candidates:\n"),),
        ("tests/test_capture.py::test_degenerate_parameter_is_refused_by_name",
         "tests/test_capture_megatron_core.py::"
         "test_a_constant_shard_is_refused_unless_megatron_places_it")),
    Mutation(
        "capture-partial-view-taken-whole",
        "a view written in place counts as all of its storage whatever its extent, so a "
        "read of its base after a write to part of it takes the part for the whole",
        "capture's memory written in place",
        (Patch("tvsmt/capture/trace.py",
               "        return (isinstance(val, torch.Tensor) and val.storage_offset() == 0\n",
               "        return (isinstance(val, torch.Tensor) or val.storage_offset() == 0\n"),),
        ("tests/test_capture_inplace.py::"
         "test_what_the_capture_cannot_follow_is_refused_in_one_line",)),
    Mutation(
        "capture-out-form-not-written",
        "an out= form (torch.exp(x, out=x)) computes its value but does not make it the "
        "written tensor's new version: later reads see the old values",
        "capture's memory written in place",
        (Patch("tvsmt/capture/trace.py",
               "        for w in written_fx:\n            self.wrote(w, outs)\n",
               "        for w in written_fx[1:]:\n            self.wrote(w, outs)\n"),),
        ("tests/test_capture_inplace.py::"
         "test_memory_written_in_place_is_captured_as_torch_computes_it",)),
    Mutation(
        "capture-empty-read-as-zeros",
        "uninitialised memory (torch.empty) that the step reads is captured as zeros",
        "capture's memory written in place",
        (Patch("tvsmt/capture/trace.py", "        return _values_ignored(node)\n",
               "        return True\n"),),
        ("tests/test_capture_inplace.py::"
         "test_what_the_capture_cannot_follow_is_refused_in_one_line",)),
    Mutation(
        "capture-uninitialised-read-allowed",
        "an operator reading uninitialised memory (torch.empty given its values by `.data =`, "
        "unseen by tracing) is captured as it is, computing on values it does not have",
        "capture's memory written in place",
        (Patch("tvsmt/capture/trace.py",
               "        read = [t for t in inputs if t in self.uninitialised]\n",
               "        read = []\n"),),
        ("tests/test_capture_inplace.py::"
         "test_what_the_capture_cannot_follow_is_refused_in_one_line",), fast=True),
    Mutation(
        "evaluation-token-ids-real",
        "random evaluation gives token ids small integers only together with every other "
        "input (which overflows exponentials), never beside real weights",
        "random evaluation",
        (Patch("tvsmt/encoding/concrete.py",
               "    return [(b, alone) for b in (4, 4, 16, 16, 64, 64)]\n",
               "    return []\n"),),
        ("tests/test_evaluation_selection.py::"
         "test_a_bug_only_integer_token_ids_show_is_a_violation",), fast=False),
    Mutation(
        "evaluation-branch-points-unused",
        "random evaluation draws the symbols that select alone from small integers only, "
        "never from their conditions' branch points (a label ignored at -100)",
        "random evaluation",
        (Patch("tvsmt/encoding/concrete.py",
               "        rare = sorted(v for v in (only or {}).get(n, ()) if not 0 <= v < ints)\n",
               "        rare = []\n"),),
        ("tests/test_evaluation_selection.py::"
         "test_a_mean_of_ranks_means_is_a_violation_where_labels_are_ignored",), fast=False),
    Mutation(
        "evaluation-evaluator-shared-by-names",
        "random evaluation reuses a points evaluator whose points have the same symbols, "
        "whatever their values: a stage evaluated at other points gets the old terms' values",
        "random evaluation",
        (Patch("tvsmt/encoding/concrete.py",
               "    key = (n, tuple((name, col.tobytes()) for name, col in sorted(columns.items())))\n",
               "    key = (n, tuple(sorted(columns)))\n"),),
        ("tests/test_encoding_cost.py::"
         "test_other_points_of_the_same_symbols_are_not_served_old_values",), fast=True),
    Mutation(
        "capture-hooks-left-on-the-real-tensor",
        "the parameters the step traces keep their identity, but the post-accumulate-grad "
        "hooks registered on them (a gradient reduction) stay with the untraced tensor",
        "capture's parameters",
        (Patch("tvsmt/capture/trace.py",
               "            if hooks:\n                orig._post_accumulate_grad_hooks = None\n",
               "            if False:\n                orig._post_accumulate_grad_hooks = None\n"),),
        ("tests/test_capture_deepspeed.py::"
         "test_hooks_registered_on_parameters_when_built_run_in_the_traced_step",), fast=False),
    Mutation(
        "capture-held-part-misplaced",
        "a stale contiguous view rederived from what was written into its storage slices "
        "each written value from the written part's start, not from where the value begins "
        "(a part cut short on the left gives another part's elements)",
        "capture's memory written in place",
        (Patch("tvsmt/capture/trace.py",
               "                                      (Ref(0), 0, at - first, stop - first), [flat],\n",
               "                                      (Ref(0), 0, at - a, stop - a), [flat],\n"),),
        ("tests/test_capture_inplace.py::test_memory_written_in_place_is_captured_as_torch_"
         "computes_it",), fast=False),
    Mutation(
        "capture-stale-view-taken-fresh",
        "a view of a tensor that an in-place write made stale is taken as current",
        "capture's memory written in place",
        (Patch("tvsmt/capture/trace.py",
               "                self.stale_views[user] = seen\n",
               "                pass\n"),),
        ("tests/test_capture_inplace.py::test_memory_written_in_place_is_captured_as_torch_"
         "computes_it",), fast=False),
    Mutation(
        "capture-zero-partition-unread",
        "under DeepSpeed ZeRO-1/2 the capture reads `.grad` (None) instead of the gradient "
        "partition each rank keeps",
        "capture's parameters",
        (Patch("tvsmt/capture/zero.py",
               "    if stage is None or stage == 0:\n        return None\n",
               "    if True:\n        return None\n"),),
        ("tests/test_capture_deepspeed.py::test_zero_claims_each_rank_s_partition_only",)),
    Mutation(
        "capture-zero-offset-ignored",
        "a ZeRO partition's first piece is taken to start at its parameter's first element, "
        "not `first_offset` elements into it",
        "capture's parameters",
        (Patch("tvsmt/capture/zero.py",
               "            start = int(offsets[group]) if k == 0 else 0\n",
               "            start = 0\n"),),
        ("tests/test_capture_deepspeed.py::test_zero_claims_each_rank_s_partition_only",)),
    Mutation(
        "capture-data-assignment-untraced",
        "`t.data = v` during the trace leaves the tracer's record of t as it was (its old "
        "node), so later reads of t take the old values",
        "capture's memory written in place",
        (Patch("tvsmt/capture/trace.py",
               "        if proxy is not None:\n            set_proxy_slot(tensor, mode.tracer, proxy)\n",
               "        if proxy is None:\n            set_proxy_slot(tensor, mode.tracer, proxy)\n"),),
        ("tests/test_capture_inplace.py::"
         "test_memory_written_in_place_is_captured_as_torch_computes_it",)),
    Mutation(
        "capture-parameter-attributes-dropped",
        "the parameters, while they are the traced tensors, lose what the code set on them "
        "(Megatron's sequence_parallel mark), so a step that reads it traces another program",
        "capture",
        (Patch("tvsmt/capture/trace.py",
               "            orig.__dict__.update(own)\n",
               "            pass\n"),),
        ("tests/test_capture_megatron_core.py::"
         "test_megatron_core_gpt_model_with_sequence_parallelism_is_equivalent",), fast=False),
    Mutation(
        "capture-overwritten-values-read",
        "an op that overwrites or ignores its first argument's values (copy_, baddbmm with "
        "beta 0) is taken to read them: a reused buffer is refused as uninitialised memory",
        "capture's memory written in place",
        (Patch("tvsmt/capture/trace.py",
               "    return name in OVERWRITING_OPS or (name == \"aten.baddbmm.default\" and "
               "_beta(fx_node) == 0)\n",
               "    return False\n"),),
        ("tests/test_capture_inplace.py::"
         "test_memory_written_in_place_is_captured_as_torch_computes_it",)),
    Mutation(
        "capture-stale-read-unchecked",
        "a read of a tensor an in-place op changed through an alias is taken as its old value "
        "even where its values are read (only a view whose values nothing reads may be)",
        "capture's memory written in place",
        (Patch("tvsmt/capture/trace.py",
               "            if str(user.target) in PURE_VIEW_OPS and _values_ignored(user):\n",
               "            if True:\n"),),
        ("tests/test_capture_inplace.py::"
         "test_what_the_capture_cannot_follow_is_refused_in_one_line",), fast=True),
    Mutation(
        "evaluation-mixed-points-need-rare-values",
        "random evaluation adds its mixed points (integer token ids beside real weights) only "
        "for out-of-reach branch points, not where integer points everywhere overflowed",
        "random evaluation",
        (Patch("tvsmt/encoding/concrete.py",
               "    if not alone or not (rare or int_points_failed):\n",
               "    if not alone or not rare:\n"),),
        ("tests/test_evaluation_selection.py::"
         "test_a_bug_only_integer_token_ids_show_is_a_violation",
         "tests/test_evaluation_selection.py::"
         "test_mixed_points_only_where_they_can_tell_more")),
    Mutation(
        "divisor-search-skips-relations",
        "shape reduction's divisor search checks a product relation only when a class of its "
        "left side is chosen last, so a relation closed by its right side goes unchecked",
        "shape reduction",
        (Patch("tvsmt/shapes/dims.py", "        for c in set(rel[0] + rel[1]):\n",
               "        for c in set(rel[0]):\n"),),
        ("tests/test_encoding.py::"
         "test_divisor_search_over_thousands_of_related_classes_needs_no_recursion",
         "tests/test_encoding.py::test_divisor_solver_keeps_partitions_products_and_minimums"),
        fast=True),
    Mutation(
        "softmax-abstracts-undeclared",
        "the softmax entry's declaration of the real functions it leaves uninterpreted "
        "omits the division its rule applies",
        "operator registry: declared abstractions",
        (Patch("tvsmt/ops/definitions/llama.py",
               'abstracts=("uf_exp", "uf_recip"), reads_mirrors=True))',
               'abstracts=("uf_exp",), reads_mirrors=True))'),),
        ("tests/test_ops_torch.py::"
         "test_rules_apply_only_the_uninterpreted_functions_they_declare",)),
    Mutation(
        "division-drops-its-divisor",
        "division by a tensor multiplies by the reciprocal of one, whatever the divisor",
        "encoding: division as x * uf_recip(y)",
        (Patch("tvsmt/ops/backend.py",
               'return np.asarray(x, dtype=object) * self._map1("uf_recip", y)',
               'return np.asarray(x, dtype=object) * self._map1("uf_recip", y * 0 + 1)'),),
        ("tests/test_capture_token_loss.py::"
         "test_division_by_a_tensor_is_linear_in_what_it_divides_and_nothing_more",),
        fast=True),
    Mutation(
        "update-witnessed-by-values",
        "the concrete run compares an updated parameter by its values, not by the step it "
        "took: a wrong step of a small learning rate goes unwitnessed",
        "capture: concrete witnesses of failing claims",
        (Patch("tvsmt/capture/build.py",
               "base = s_values.get(start_id)",
               "base = None"),),
        ("tests/test_capture_optimizer.py::"
         "test_a_wrong_step_of_a_small_learning_rate_is_witnessed_by_the_step_it_took",)),
    Mutation(
        "update-witness-absolute-tolerance",
        "an updated parameter's step is compared at the values' absolute tolerance (1e-5), "
        "not at the step's own scale: a wrong step of a learning rate of 3e-6 goes unwitnessed",
        "capture: concrete witnesses of failing claims",
        (Patch("tvsmt/capture/build.py",
               "atol = 1e-4 * float(want.abs().max()) + slack",
               "atol = 1e-5 * (1 + float(want.abs().max())) + slack"),),
        ("tests/test_capture_optimizer.py::"
         "test_a_wrong_step_of_a_small_learning_rate_is_witnessed_by_the_step_it_took",)),
    Mutation(
        "sqrt-square-of-anything",
        "the square of uf_sqrt(t) is rewritten to t whatever t, also where t may be negative "
        "(the real sqrt is NaN there)",
        "encoding: the square of a root of a sum of squares",
        (Patch("tvsmt/ops/backend.py",
               "                    and self._nonnegative(t.arg(0)):",
               "                    and (self._nonnegative(t.arg(0)) or True):"),),
        ("tests/test_ops_aten.py::"
         "test_the_square_of_the_root_of_a_sum_of_squares_is_the_sum_and_nothing_else",),
        fast=True),
    Mutation(
        "unpaired-factors-nonnegative",
        "a product counts as nonnegative when its factors pair up, ignoring an odd factor",
        "encoding: the square of a root of a sum of squares",
        (Patch("tvsmt/ops/backend.py",
               "known[node] = all(known[c] for c, o in odd.items() if o)",
               "known[node] = all(known[c] or not c.is_constant() for c, o in odd.items() if o)"),),
        ("tests/test_ops_aten.py::"
         "test_the_square_of_the_root_of_a_sum_of_squares_is_the_sum_and_nothing_else",)),
    Mutation(
        "max-operands-in-call-order",
        "max(a, b) is built with its operands in the order given: max(x, c) and max(c, x) "
        "are different terms",
        "encoding: max's operands in a canonical order",
        (Patch("tvsmt/ops/backend.py",
               "        if swap:\n            a, b = b, a\n", ""),),
        ("tests/test_ops_aten.py::test_max_of_two_terms_is_one_term_whichever_comes_first",),
        fast=True),
    Mutation(
        "max-order-by-creation",
        "max's operands ordered by pysmt's node ids, that is by the order the terms were made",
        "encoding: max's operands in a canonical order",
        (Patch("tvsmt/ops/backend.py",
               "swap = self._order_key(b) < self._order_key(a)",
               "swap = b.node_id() < a.node_id()"),),
        ("tests/test_ops_aten.py::test_max_of_two_terms_is_one_term_whichever_comes_first",)),
    Mutation(
        "optimizer-step-counter-from-zero",
        "the step counter of an optimizer stepped when it was built is traced as a fresh "
        "one's: Adam's bias corrections of a first step, on single and ranks alike",
        "capture: optimizer state from steps taken when built",
        (Patch("tvsmt/capture/trace.py",
               "st[k] = torch.tensor(st[k].item(), dtype=st[k].dtype)",
               "st[k] = torch.tensor(0.0, dtype=st[k].dtype)"),),
        ("tests/test_capture_optimizer.py::"
         "test_a_captured_second_step_leaves_the_parameters_torch_leaves",), fast=True),
    Mutation(
        "optimizer-state-left-unclaimed",
        "the optimizer state a step leaves for the next step is not claimed: a rank that "
        "steps its parameters right but leaves another momentum buffer passes",
        "capture: optimizer state from steps taken when built",
        (Patch("tvsmt/capture/lineages.py",
               "            _claim_states(single, prog, r, name, own, by_input, claims, path)\n",
               ""),),
        ("tests/test_capture_optimizer.py::"
         "test_the_state_an_optimizer_leaves_for_the_next_step_is_claimed[sgd-1]",),
        fast=True),
    Mutation(
        "state-of-no-block-left-unclaimed",
        "optimizer state whose block cannot be told (factored, or of another shape, on a "
        "split weight) is left unclaimed instead of refused: a rank that leaves other row "
        "sums of a factored second moment passes",
        "capture: optimizer state from steps taken when built",
        (Patch("tvsmt/capture/lineages.py",
               "        if block is None or tuple(b - a for a, b in block) != r_shape:\n",
               "        if block is None or tuple(b - a for a, b in block) != r_shape:\n"
               "            continue\n"),
         Patch("tvsmt/capture/lineages.py",
               "    if len(s_shape) == len(s_param) and all(s in (p, 1) for s, p in zip(",
               "    if s_shape == s_param and all(s in (p, 1) for s, p in zip("),),
        ("tests/test_capture_optimizer.py::"
         "test_factored_state_of_split_weights_is_claimed_by_the_blocks_it_keeps",
         "tests/test_capture_optimizer.py::"
         "test_state_of_a_split_weight_that_is_no_block_of_the_single_s_is_refused"),
        fast=True),
    Mutation(
        "megatron-ddp-hooks-left-on-built-tensors",
        "Megatron-Core DDP's backward hooks are not registered on the traced parameters: no "
        "gradient reaches main_grad in the trace (the claims read an all-reduced zero)",
        "capture: Megatron-Core DDP",
        (Patch("tvsmt/capture/megatron_ddp.py",
               "                handles.append(param.register_post_accumulate_grad_hook(\n"
               "                    lambda p, hook=hook: hook()))\n",
               "                pass\n"),),
        ("tests/test_capture_megatron_core.py::"
         "test_megatron_core_ddp_gradients_are_its_main_grads_and_proven[--]",),
        fast=True),
    Mutation(
        "megatron-ddp-grad-not-main-grad",
        "the gradient of a Megatron-Core DDP parameter is read from .grad, which its hooks "
        "cleared: its main_grad is never claimed",
        "capture: Megatron-Core DDP",
        (Patch("tvsmt/capture/megatron_ddp.py",
               "    return param.main_grad\n",
               "    return param.grad\n"),),
        ("tests/test_capture_megatron_core.py::"
         "test_megatron_core_ddp_gradients_are_its_main_grads_and_proven[--]",),
        fast=True),
    Mutation(
        "frozen-parameters-traced-trainable",
        "every floating parameter requires grad in the trace: a parameter the single model "
        "freezes gets a gradient (and an update) there, so ranks that train it pass",
        "capture: gradients and their owners",
        (Patch("tvsmt/capture/trace.py",
               "            frozen = {n for n in pnames if not self.params[n].requires_grad}\n",
               "            frozen = set()\n"),),
        ("tests/test_capture.py::test_a_gradient_only_the_ranks_compute_is_a_violation",),
        fast=True),
    Mutation(
        "rank-only-gradient-unchecked",
        "a gradient the ranks compute of a parameter the single step neither differentiates "
        "nor updates is skipped: nothing checks it",
        "capture: gradients and their owners",
        (Patch("tvsmt/capture/lineages.py",
               "            if s_grad is None and s_name not in single.updated and (\n",
               "            if False and (\n"),),
        ("tests/test_capture.py::test_a_gradient_only_the_ranks_compute_is_a_violation",),
        fast=True),
    Mutation(
        "single-partitions-unclaimed",
        "the single device's partitioned gradients (DeepSpeed ZeRO on one rank) are dropped "
        "like a rank's .grad: no gradient is claimed, and a skipped reduction passes",
        "capture: gradients and their owners",
        (Patch("tvsmt/capture/trace.py",
               "        if (piece_blocks or partitioned) and self.rank is None:\n",
               "        if False:\n"),),
        ("tests/test_capture_deepspeed.py::"
         "test_a_single_model_under_deepspeed_too_claims_its_whole_partitions[2]",),
        fast=True),
    Mutation(
        "partition-blocks-not-shifted",
        "a partition's block of a tensor-parallel rank's parameter is taken as a block of the "
        "single parameter (Megatron's distributed optimizer with tp > 1)",
        "capture: Megatron-Core DDP",
        (Patch("tvsmt/capture/lineages.py",
               "    if base is None:\n        return block\n",
               "    if True:\n        return block\n"),),
        ("tests/test_capture_megatron_core.py::"
         "test_megatron_distributed_optimizer_claims_each_rank_s_shard",),
        fast=True),
    Mutation(
        "view-inner-axes-reduced",
        "shape reduction reduces every axis of a merged or split run of a view, so two views "
        "of one buffer can decode its elements differently (a gradient written into DDP's "
        "flat buffer as [2, 16] and read back as [8, 4])",
        "shape reduction",
        (Patch("tvsmt/ops/definitions/layout.py",
               "                for i in group[1:]:\n                    c.eq(t[i], t.orig[i])\n",
               "                for i in group[1:]:\n                    pass\n"),),
        ("tests/test_capture_megatron_core.py::"
         "test_no_gradient_of_a_gpt_model_under_megatron_ddp_is_refuted",),
        fast=True),
    Mutation(
        "answers-remembered-across-solvers",
        "a run's remembered answers are looked up by script alone: one solver's answer "
        "stands for another's (a cached verdict of another solver taken as a proof)",
        "solving: answers remembered within a run",
        (Patch("tvsmt/solving/dispatch.py",
               "return (dg, names, opts.timeout, opts.fresh, dg in refuted,",
               "return (dg, opts.timeout, opts.fresh, dg in refuted,"),),
        ("tests/test_verdicts.py::"
         "test_answers_remembered_in_a_run_are_asked_once_per_solver_and_timeout",),
        fast=True),
    Mutation(
        "settled-budget-for-claims",
        "once a confirmed bug decides a capture's verdict, a script a claim's stage shares "
        "with a hypothesis's gets the hypotheses' short budget too (a claim inconclusive "
        "that the run's timeout would have proven)",
        "solving: answers remembered within a run",
        (Patch("tvsmt/solving/dispatch.py",
               "kinds[dg] = kinds.get(dg, True) and bool(lins[o.stage.target].hypothesis)",
               "kinds[dg] = kinds.get(dg, False) or bool(lins[o.stage.target].hypothesis)"),),
        ("tests/test_verdicts.py::"
         "test_the_settled_budget_is_for_stages_that_only_prove_hypotheses",), fast=True),
    Mutation(
        "cast-held-whatever-its-values",
        "a rank input of a narrower floating dtype than the single tensor is taken to hold "
        "the block without comparing values: a rank with other weights passes as a copy",
        "capture: inputs held cast to a narrower dtype",
        (Patch("tvsmt/capture/lineages.py",
               "    return torch.equal(block.to(mine.dtype), mine)\n",
               "    return True\n"),),
        ("tests/test_capture_casts.py::"
         "test_a_rank_whose_parameter_is_not_the_cast_of_the_single_one_is_refused",),
        fast=True),
    Mutation(
        "cast-inputs-rounded-in-the-concrete-run",
        "the concrete run computes a rank's cast input from its rounded copy, not from the "
        "block the proof is over: bf16 rounding reads as a contradiction of the proof",
        "capture: inputs held cast to a narrower dtype",
        (Patch("tvsmt/capture/build.py",
               "        p_inputs.update(cast_inputs(single, lineages, p_inputs))\n",
               "        pass\n"),),
        ("tests/test_capture_casts.py::"
         "test_parameters_cast_to_bfloat16_before_the_step_are_equivalent",)),
    Mutation(
        "python-floats-exact-in-float32",
        "a Python float argument of a float32 op is written as the double it is, not as the "
        "float32 the kernel computes with: 0.05 and a float32 tensor of 0.05 differ",
        "capture: Python scalars at the op's precision",
        (Patch("tvsmt/capture/trace.py",
               "        float32 = computes_in_float32(node)\n",
               "        float32 = False\n"),),
        ("tests/test_capture_scalars.py::"
         "test_a_python_float_and_a_float32_tensor_of_it_are_one_value",)),
    Mutation(
        "python-floats-rounded-in-float64",
        "Python floats are rounded to float32 whatever the op's dtype, also in a float64 "
        "program, where 0.05 and float32's 0.05 then pass as one value",
        "capture: Python scalars at the op's precision",
        (Patch("tvsmt/capture/trace.py",
               "    return bool(dtypes) and torch.float64 not in dtypes",
               "    return bool(dtypes)"),),
        ("tests/test_capture_scalars.py::"
         "test_scalars_that_differ_where_the_op_computes_stay_apart",)),
    Mutation(
        "foreach-loop-in-place-result-dropped",
        "an in-place foreach op whose per-tensor op is out of place (`_foreach_maximum_`) "
        "computes the results and leaves the list as it was",
        "capture: foreach kernels as per-tensor loops",
        (Patch("tvsmt/capture/foreach.py",
               "out = args[0][i].copy_(out)", "out = out"),),
        ("tests/test_capture_foreach.py::"
         "test_each_loop_leaves_what_torch_s_foreach_kernel_leaves",),
        fast=True),
    Mutation(
        "foreach-scalars-by-position",
        "addcdiv's per-element `scalars` are passed by position, where the per-tensor op "
        "takes the value by keyword only",
        "capture: foreach kernels as per-tensor loops",
        (Patch("tvsmt/capture/foreach.py",
               'keywords = {**KEYWORD_ONLY, "scalars": "value"} if base in ADDC else '
               'KEYWORD_ONLY',
               "keywords = KEYWORD_ONLY"),),
        ("tests/test_capture_foreach.py::"
         "test_each_loop_leaves_what_torch_s_foreach_kernel_leaves",
         "tests/test_capture_optimizer.py::"
         "test_torch_s_clipping_and_optimizers_with_gradients_zeroed")),
    Mutation(
        "concrete-run-in-the-code-s-dtype",
        "the capture's concrete run computes in the dtypes the code asks for (bf16 under "
        "autocast), so bf16's rounding reads as a contradiction of every proof",
        "capture: the concrete run over the reals",
        (Patch("tvsmt/capture/execute.py",
               "    if isinstance(template, torch.dtype) and template.is_floating_point:\n"
               "        return torch.float64\n", ""),
         Patch("tvsmt/capture/execute.py", "            values[t] = v.double()",
               "            values[t] = v")),
        ("tests/test_capture_optimizer.py::test_a_bfloat16_forward_is_checked_over_the_reals",)),
    Mutation(
        "aten-softmax-abstracts-undeclared",
        "ATen's softmax entry declares the exponential only, while its rule divides by "
        "be.div",
        "operator registry: declared abstractions",
        (Patch("tvsmt/ops/definitions/aten_nn.py",
               '     abstracts=("uf_exp", "uf_recip"))\ndef _safe_softmax',
               '     abstracts=("uf_exp",))\ndef _safe_softmax'),),
        ("tests/test_ops_aten.py::"
         "test_symbolic_terms_apply_only_the_uninterpreted_functions_declared",)),
    Mutation(
        "expert-start-not-kept",
        "shape reduction of the expert axis forgets to keep a rank's first expert a whole "
        "position",
        "shape reduction (experts)",
        (Patch("tvsmt/ops/definitions/moe.py", "        c.keep_boundary(w11[0], int(start))\n",
               ""),),
        ("tests/test_encoding_cost.py::test_the_expert_axis_is_reduced_with_its_ranges",
         "tests/test_encoding_cost.py::test_an_expert_range_off_by_part_of_a_range_is_caught"),
        fast=True),
    Mutation(
        "stream-node-ids-unchecked",
        "the JSON Lines reader keeps node ids as hashes and never compares them at the end, so "
        "an id used twice in different blocks reads",
        "streaming reader (id hashes)",
        (Patch("tvsmt/plan/stream.py", "    if not st.node_hashes:\n",
               "    if True:\n"),),
        ("tests/test_plan_stream.py::test_a_node_id_used_twice_is_found_across_blocks",),
        fast=True),
    Mutation(
        "slice-check-per-slice",
        "the columnar lineage slice check (reader._slices_fit) checks each distinct slice "
        "once, against the shape of the last lineage that uses it, instead of each (full "
        "shape, slice) pair",
        "columnar slice check",
        (Patch("tvsmt/plan/reader.py",
               "    pairs = np.unique(np.repeat(code, n_parts) * n_slices + "
               "np.asarray(cols.slice_index))\n",
               "    pairs = np.repeat(code, n_parts) * n_slices + np.asarray(cols.slice_index)\n"
               "    last = dict(zip((pairs % n_slices).tolist(), pairs.tolist()))\n"
               "    pairs = np.array(sorted(last.values()), np.int64)\n"),),
        ("tests/test_plan_reader.py::test_bad_plan_one_line_error_exit_2"
         "[slice_of_another_lineage]",),
        fast=True),
    Mutation(
        "slice-check-bounds-dropped",
        "the columnar lineage slice check (reader._slices_fit) compares only the number of "
        "dimensions, not the bounds",
        "columnar slice check",
        (Patch("tvsmt/plan/reader.py",
               "        if len(key) != len(full) or not all(0 <= s < e <= n for (s, e), n in "
               "zip(key, full)):\n",
               "        if len(key) != len(full):\n"),),
        ("tests/test_plan_reader.py::"
         "test_the_columnar_slice_check_is_taken_on_a_real_plan_and_finds_a_shifted_slice",),
        fast=True),
    Mutation(
        "stream-check-attrs-any",
        "the checks alone (check_stream) check node attributes to be an object or null "
        "without building them; the mutation takes any value, so a node whose attributes "
        "are no object passes",
        "streaming reader (the checks skip the attributes' contents)",
        (Patch("tvsmt/plan/stream.py",
               "    attrs: Optional[_AnyObject] = None\n",
               "    attrs: Any = None\n"),),
        ("tests/test_stream.py::test_a_malformed_file_gets_the_record_checks_own_error",),
        fast=True),
    Mutation(
        "scan-window-numbers-shifted",
        "the one-pass JSON Lines reading (plan/scan.py) numbers the names found among the "
        "last two blocks' declarations one too high",
        "one-pass JSON Lines reading (names looked up by Arrow in the last blocks)",
        (Patch("tvsmt/plan/scan.py",
               "found.filter(found.is_valid()).to_numpy() + self.window_first\n",
               "found.filter(found.is_valid()).to_numpy() + self.window_first + 1\n"),),
        ("tests/test_scan.py::test_the_scan_reads_the_plan_iter_records_reads",),
        fast=True),
    Mutation(
        "scan-declared-before-unchecked",
        "the one-pass reading never checks that a tensor is declared before the node naming "
        "it (it numbers names found anywhere in the block or at the end)",
        "one-pass JSON Lines reading (the checks over whole columns)",
        (Patch("tvsmt/plan/scan.py",
               "            if (t_line[num[named]] >= reader_line).any():\n",
               "            if False:\n"),),
        ("tests/test_scan.py::test_no_damaged_file_is_scanned",), fast=True),
    Mutation(
        "scan-topological-unchecked",
        "the one-pass reading never checks that a tensor is written before it is read",
        "one-pass JSON Lines reading (the checks over whole columns)",
        (Patch("tvsmt/plan/scan.py",
               "            if ((w < self.n_n) & (w >= reader)).any():\n",
               "            if False:\n"),),
        ("tests/test_scan.py::test_no_damaged_file_is_scanned",), fast=True),
    Mutation(
        "scan-equal-hashes-trusted",
        "the one-pass reading takes names with equal hashes for distinct without comparing "
        "them, so a node id used twice (or a tensor declared twice) reads",
        "one-pass JSON Lines reading (ids and names distinct by hash, then by name)",
        (Patch("tvsmt/plan/scan.py", "        if not len(same):\n            return\n",
               "        if True:\n            return\n"),),
        ("tests/test_scan.py::test_no_damaged_file_is_scanned",), fast=True),
    Mutation(
        "scan-equal-hashes-are-duplicates",
        "the one-pass reading takes names with equal hashes for the same name",
        "one-pass JSON Lines reading (ids and names distinct by hash, then by name)",
        (Patch("tvsmt/plan/scan.py", "        if len(set(got)) != len(got):\n",
               "        if got:\n"),),
        ("tests/test_scan.py::test_equal_hashes_never_merge_names",), fast=True),
    Mutation(
        "scan-attrs-any",
        "the one-pass reading keeps node attributes as their text and never checks that the "
        "text is an object or null",
        "one-pass JSON Lines reading (attributes kept as text)",
        (Patch("tvsmt/plan/scan.py",
               "            if text[:1] not in (b\"{\", b\"n\"):  # decoded JSON: an object, "
               "or null\n",
               "            if False:\n"),),
        ("tests/test_scan.py::test_no_damaged_file_is_scanned",), fast=True),
    Mutation(
        "scan-lineage-shape-unchecked",
        "the one-pass reading never compares a lineage tensor's shape with its slice's",
        "one-pass JSON Lines reading (the checks over whole columns)",
        (Patch("tvsmt/plan/scan.py",
               "            if (t_shape[s_num] != np.repeat(want[slice_index], p_len)).any():\n",
               "            if False:\n"),),
        ("tests/test_scan.py::test_no_damaged_file_is_scanned",), fast=True),
    Mutation(
        "stream-world-unchecked",
        "the JSON Lines reading takes a node on any rank or micro-batch, in any world",
        "JSON Lines reading (the world)",
        (Patch("tvsmt/plan/stream.py", "    problem = R.placement_problem((rec.rank,), (rec.mb,), st.extent)\n",
               "    problem = None\n"),
         Patch("tvsmt/plan/stream.py", "    if R.placement_problem(map(_RANK, nrecs), map(_MB, nrecs), st.extent) is not None:\n",
               "    if False:\n")),
        ("tests/test_plan_stream.py::test_a_node_outside_the_world_is_an_input_error_in_both_forms",),
        fast=True),
    Mutation(
        "scan-world-unchecked",
        "the one-pass reading takes a node on any rank or micro-batch",
        "one-pass JSON Lines reading (the world)",
        (Patch("tvsmt/plan/scan.py", "            raise NotScanned(\"a node outside the world\")\n",
               "            pass\n"),),
        ("tests/test_plan_stream.py::test_a_node_outside_the_world_is_an_input_error_in_both_forms",),
        fast=True),
    Mutation(
        "scan-checksum-unchecked",
        "the one-pass reading never compares the trailer's checksum with the bytes read",
        "one-pass JSON Lines reading (the trailer)",
        (Patch("tvsmt/plan/scan.py", "                or t.lineages != n_lin or t.crc32 != self.crc):\n",
               "                or t.lineages != n_lin):\n"),),
        ("tests/test_stream.py::test_a_malformed_file_gets_the_record_checks_own_error",),
        fast=True),
    Mutation(
        "scan-records-lose-attrs",
        "the records the one-pass reading builds back from its columns (the kept units') "
        "lose their attributes",
        "one-pass JSON Lines reading (records built on demand)",
        (Patch("tvsmt/plan/scan.py", "                     _ATTRS_TEXT.decode(texts[t]) or {}, sources[s])\n",
               "                     {}, sources[s])\n"),),
        ("tests/test_scan.py::test_the_scan_reads_the_plan_iter_records_reads",), fast=True),
    Mutation(
        "scan-merge-numbers-not-offset",
        "the one-pass reading by two processes merges the second part's tensor numbers "
        "without offsetting them by the first part's tensors",
        "one-pass JSON Lines reading by two processes (the merge)",
        (Patch("tvsmt/plan/scan.py",
               '        self.cols["in_num"].append(shifted(cols["in_num"], t0))\n',
               '        self.cols["in_num"].append(cols["in_num"])\n'),),
        ("tests/test_scan.py::test_two_halves_read_the_same_plan_wherever_the_file_is_cut",),
        fast=True),
    Mutation(
        "scan-merge-sections-unchecked",
        "the merge never checks that the second part's sections continue the first's",
        "one-pass JSON Lines reading by two processes (the merge)",
        (Patch("tvsmt/plan/scan.py",
               "            if part.first_section != self.section + 1:\n",
               "            if False:\n"),),
        ("tests/test_scan.py::test_a_damage_in_either_half_is_never_scanned",), fast=True),
    Mutation(
        "sum-pattern-unverified",
        "canonical_inputs gives every sum over units the level of the first sum whose "
        "pattern hashed alike, without checking the patterns are the same",
        "sums over units judged once per pattern of units (fold/table.canonical_inputs)",
        (Patch("tvsmt/fold/table.py",
               "            levels[these] = np.where(same, level_of[which], -1)\n",
               "            levels[these] = level_of[which]\n"),),
        ("tests/test_fold_tables.py::test_sums_over_units_are_grouped_by_pattern_exactly",),
        fast=True),
    Mutation(
        "object-reader-lax-types",
        "the in-memory reader (reader.plan_from_object, the streamed generator's) converts "
        "with msgspec's lax mode, so a float rank, a boolean dimension or a string number "
        "is coerced instead of refused as plan_from_dict refuses it",
        "in-memory plans through the typed fast path (reader.plan_from_object)",
        (Patch("tvsmt/plan/reader.py",
               "_build(msgspec.convert(data, RawPlan, dec_hook=decode_scale), path)",
               "_build(msgspec.convert(data, RawPlan, dec_hook=decode_scale, strict=False), "
               "path)"),),
        ("tests/test_plan_reader.py::test_decoder_checks_agree_with_the_reference_validator",),
        fast=True),
    Mutation(
        "arrow-numbering-undeclared-absent",
        "Arrow's tensor numbering gives a name the table does not hold the number of an "
        "absent slot, so a node reading or writing an undeclared tensor reads as one with a "
        "missing input",
        "tensor numbering by Arrow (tvsmt/plan/numbering.py)",
        (Patch("tvsmt/plan/numbering.py", "pc.fill_null(found, UNDECLARED)",
               "pc.fill_null(found, ABSENT)"),),
        ("tests/test_plan_numbering.py::test_lookalikes_are_undeclared_and_declared_names_found",
         "tests/test_plan_reader.py::test_bad_plan_one_line_error_exit_2"),
        fast=True),
    Mutation(
        "forked-numbering-answer-unchecked",
        "the reader takes the forked child's tensor numbers without checking that they are "
        "for the names this process decoded (the same columns, lengths and count)",
        "tensor numbering in a forked process (tvsmt/plan/numbering.py ForkedNumbering)",
        (Patch("tvsmt/plan/numbering.py",
               "            return None  # other names than this process decoded, or cut "
               "short\n",
               "            pass\n"),),
        ("tests/test_plan_numbering.py::"
         "test_a_child_that_does_not_answer_for_these_names_leaves_the_numbering_here",),
        fast=True),
    Mutation(
        "fold-child-second-fold-is-first",
        "a plan loaded and folded in a forked process: the parent takes the child's first "
        "fold again where the second (one more uniform replica and micro-batch) is asked for",
        "loading and folding in a forked process (tvsmt/fold_child.py fold_in_child)",
        (Patch("tvsmt/fold_child.py", "        got = folds[extra]\n",
               "        got = folds[0]\n"),),
        ("tests/test_fold_in_child.py::test_the_second_fold_comes_from_the_child",),
        fast=True),
    Mutation(
        "fold-child-guess-unconfirmed",
        "the folded pair the forked process guessed before checking every unit is judged "
        "without comparing it with the pair it answered",
        "encoding the forked process's early guess of the folded pair (tvsmt/fold_child.py "
        "_Ahead)",
        (Patch("tvsmt/fold_child.py",
               "        return not isinstance(fold, str) and fold[0] == self.blob\n",
               "        return True\n"),),
        ("tests/test_fold_in_child.py::test_a_guess_that_is_not_the_answer_is_never_judged",),
        fast=True),
    Mutation(
        "lazy-nodes-neighbour-names",
        "a large document's nodes, read without their names and built on demand, take the "
        "inputs of the node before them",
        "nodes built on demand from the forked numbering (tvsmt/plan/reader.py _NodeBuilder)",
        (Patch("tvsmt/plan/reader.py", "self._names(*self._in, rows)",
               "self._names(*self._in, np.maximum(rows - 1, 0))"),),
        ("tests/test_fold_in_child.py::test_nodes_built_on_demand_give_the_same_report",
         "tests/test_plan_reader.py::test_fast_path_agrees_with_the_reference_validator"),
        fast=True),
    Mutation(
        "lazy-nodes-attrs-unchecked",
        "a large document's nodes, read without their names, are accepted without decoding "
        "their attribute texts (a node whose attrs is not an object passes the reader)",
        "nodes built on demand from the forked numbering (tvsmt/plan/reader.py _lazy_nodes)",
        (Patch("tvsmt/plan/reader.py", "        if len(text):\n            try:",
               "        if False:\n            try:"),),
        ("tests/test_plan_reader.py::"
         "test_nodes_built_on_demand_read_attributes_as_the_reference",),
        fast=True),
    Mutation(
        "gunzip-whole-first-member-only",
        "a gzip plan file read in one call stops at its first member (a plan written in two "
        "members, or followed by other bytes, reads as its first part)",
        "the whole-file gzip read (tvsmt/plan/reader.py gunzip_whole)",
        (Patch("tvsmt/plan/reader.py",
               "    if len(text) > limit or not inflate.eof or inflate.unused_data:",
               "    if len(text) > limit or not inflate.eof:"),),
        ("tests/test_plan_reader.py::"
         "test_a_gzip_plan_read_whole_is_the_plan_the_stream_reads",),
        fast=True),
    Mutation(
        "fold-codes-first-scale",
        "the codes a forked read computes for the fold give every lineage part the first "
        "part's scale",
        "the fold's codes computed while the reader waits for the forked numbering "
        "(tvsmt/plan/reader.py _fold_codes)",
        (Patch("tvsmt/plan/reader.py",
               "    return _part_codes(per, parts, first_use_codes(scale_at, first_scale),",
               "    return _part_codes(per, parts, np.zeros(len(scales), np.int64),"),),
        ("tests/test_fold_columns.py::"
         "test_the_codes_a_forked_read_computes_give_the_node_by_node_split",),
        fast=True),
    Mutation(
        "fold-codes-op-order",
        "the codes a forked read computes for the fold name the ops in the wrong order (the "
        "op names reversed against their codes)",
        "the fold's codes computed while the reader waits for the forked numbering "
        "(tvsmt/plan/reader.py _fold_codes)",
        (Patch("tvsmt/plan/reader.py", '"op_names": list(op_first),',
               '"op_names": list(op_first)[::-1],'),),
        ("tests/test_fold_columns.py::"
         "test_the_codes_a_forked_read_computes_give_the_node_by_node_split",),
        fast=True),
    Mutation(
        "lifeline-no-parent-guard",
        "a solver started through setpriv runs on when tvsmt died before setpriv asked for "
        "the parent-death signal (re-parented to init, it never gets it)",
        "solvers started through setpriv instead of a preexec_fn (tvsmt/solving/lifeline.py "
        "spawn_args)",
        (Patch("tvsmt/solving/lifeline.py",
               """PARENT_GUARD = '[ "$PPID" = "$1" ] || exit 1; shift; exec "$@"'""",
               """PARENT_GUARD = 'shift; exec "$@"'"""),),
        ("tests/test_lifeline.py::"
         "test_a_solver_whose_starter_died_before_the_death_signal_was_set_does_not_run",),
        fast=True),
    Mutation(
        "direct-infix-minus-swapped",
        "a - b of two symbolic terms builds b - a (every backward rule's subtraction turned "
        "around)",
        "symbolic + - * straight to the formula manager (tvsmt/ops/backend.py _direct_infix)",
        (Patch("tvsmt/ops/backend.py", "return _mgr().Minus(self, right)",
               "return _mgr().Minus(right, self)"),),
        ("tests/test_encoding.py::test_direct_infix_builds_the_very_nodes_pysmt_builds",),
        fast=True),
    Mutation(
        "attr-text-codes-ignore-text",
        "the forked reader codes every node's attributes alike (not by their text), so the "
        "fold gives every node of an op the first one's semantic attributes",
        "attribute-text codes from the forked reader (numbering.py, fold/columns.py)",
        (Patch("tvsmt/plan/numbering.py", "map(bytes, map(_ATTRS, nodes))",
               "(b'' for n in nodes)"),),
        ("tests/test_fold_columns.py::"
         "test_a_changed_attribute_in_a_folded_away_unit_is_seen_through_the_text_codes",),
        fast=True),
    Mutation(
        "capture-in-place-parameter-writes-unseen",
        "a parameter written in place by the step (the optimizer's update) is taken as "
        "unchanged: the step's result is never compared",
        "optimizer steps in the capture (tvsmt/capture/trace.py convert)",
        (Patch("tvsmt/capture/trace.py",
               "if isinstance(now, str) and now != inp.id:",
               "if isinstance(now, str) and now != now:"),),
        ("tests/test_capture_optimizer.py",)),
    Mutation(
        "capture-stale-views-read-as-they-were",
        "a stale chain of views (FSDP2's saved unsharded parameter, gathered again before the "
        "backward) keeps the values it viewed before the buffer was written again",
        "stale views rederived through their chain (tvsmt/capture/trace.py "
        "rederive_through_views)",
        (Patch("tvsmt/capture/trace.py", "                self.env[node] = new\n",
               "                self.env[node] = self.env[node]\n"),),
        ("tests/test_capture_inplace.py::"
         "test_memory_written_in_place_is_captured_as_torch_computes_it",)),
    Mutation(
        "capture-as-strided-range-from-the-base-start",
        "as_strided's storage offset taken from the viewed tensor's start, not the storage's",
        "as_strided ranges as slices (tvsmt/capture/trace.py as_strided_range)",
        (Patch("tvsmt/capture/trace.py",
               "(Ref(0), 0, start - a, end - a), [flat], (end - start,))",
               "(Ref(0), 0, start, end), [flat], (end - start,))"),),
        ("tests/test_capture_inplace.py::"
         "test_memory_written_in_place_is_captured_as_torch_computes_it",)),
    Mutation(
        "capture-zero3-partition-unchecked",
        "a ZeRO-3 partition's block taken from DeepSpeed's range without its values",
        "ZeRO-3 partitions as inputs (tvsmt/capture/lineages.py input_lineage)",
        (Patch("tvsmt/capture/lineages.py",
               "if any(not held(_view(s, block), r) for s, r in zip(single.draws, "
               "mine.draws)):\n",
               "if False:\n"),),
        ("tests/test_capture_deepspeed.py::"
         "test_a_zero_3_block_whose_values_differ_from_the_single_block_is_refused",)),
    Mutation(
        "capture-zero3-claims-from-the-start",
        "every rank's ZeRO-3 gradient piece claimed as the parameter's first elements",
        "ZeRO-3 gradient partitions as claims (tvsmt/capture/zero.py _stage3_pieces)",
        (Patch("tvsmt/capture/zero.py",
               "start = min(dist.get_rank(group=param.ds_process_group) * size, numel)",
               "start = 0"),),
        ("tests/test_capture_deepspeed.py::"
         "test_zero_3_inputs_and_claims_are_each_rank_s_partition",)),
)


@dataclass
class Outcome:
    mutation: Mutation
    status: str  # killed | SURVIVED | stale | error | timeout
    by: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status in ("killed", "equivalent")


def copy_project(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "smt_corpus")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)


def child_env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy) + (os.pathsep + env["PYTHONPATH"]
                                     if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a restored file is never read from a stale .pyc
    # No pytest plugins from entry points: the named tests need neither xdist nor
    # hypothesis's plugin (hypothesis itself still imports where a test uses it), whose
    # import was about 1 s of each mutation's 1.5-3 s
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    # Not pytest's CI mode: there a failing comparison of two long lists is explained by a
    # full difflib diff, quadratic in their length (a killed mutation's test ran for minutes
    # in CI, 2 s elsewhere). Only whether the tests fail matters here; a fixture plan that is
    # absent skips its test, and a mutation that only skips tests survives, so nothing is
    # hidden by leaving CI mode.
    for var in ("CI", "BUILD_NUMBER"):
        env.pop(var, None)
    env.setdefault("TVSMT_SHARED_PLANS", str(ROOT.parent / "shared" / "plans"))
    return env


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[int | None, str]:
    """pytest on the copy: (exit code or None on timeout, output). The child gets its own
    session, killed whole when it is over: a straggler it forked can neither keep the run
    waiting (the output goes to a file, not a pipe a straggler could hold open) nor outlive
    it. A test still running after 80% of the time dumps every thread's stack into the
    output (pytest's faulthandler), so that a timeout says where it hung."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rf",
           "--no-header", "-o", f"faulthandler_timeout={max(1, int(timeout * 0.8))}", *tests]
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as log:
        proc = subprocess.Popen(cmd, cwd=copy, env=child_env(copy), stdout=log,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        log.seek(0)
        return rc, log.read()


def first_failure(output: str) -> str:
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    return m.group(1) if m else ""


def patched_texts(copy: Path, m: Mutation) -> dict[Path, tuple[str, str]] | str:
    """{file: (original, patched)} for the copy, or why a patch is stale (nothing written)."""
    texts: dict[Path, tuple[str, str]] = {}
    for k, p in enumerate(m.patches):
        path = copy / p.file
        if not path.exists():
            return f"patch {k + 1}: {p.file} does not exist"
        original, current = texts.get(path, (path.read_text(),) * 2)
        count = current.count(p.old)
        if count != 1:
            return f"patch {k + 1}: old text found {count} times in {p.file}"
        texts[path] = (original, current.replace(p.old, p.new))
    return texts


def check_imports_the_copy(copy: Path) -> None:
    out = subprocess.run([sys.executable, "-c", "import tvsmt; print(tvsmt.__file__)"],
                         cwd=copy, env=child_env(copy), capture_output=True, text=True)
    where = Path(out.stdout.strip()).resolve()
    if copy.resolve() not in where.parents:
        sys.exit(f"mutate.py: the copy's tests would import tvsmt from {where}, not from "
                 f"{copy}: mutations would not be tested")


def run(mutations: list[Mutation], timeout: float, progress, baseline: bool = True
        ) -> list[Outcome]:
    with tempfile.TemporaryDirectory(prefix="tvsmt-mutate-") as tmp:
        copy = Path(tmp) / "project"
        copy.mkdir()
        copy_project(copy)
        check_imports_the_copy(copy)
        tests = tuple(dict.fromkeys(t for m in mutations for t in m.tests))
        if baseline:
            progress(f"baseline: {len(tests)} test selections on the unmutated copy")
            # every selection once, beside whatever else the machine runs (the CI suite's
            # other worker): more time than one mutation's
            rc, out = run_tests(copy, tests, timeout * 4)
            if rc != 0:
                why = first_failure(out) or out[-2000:]
                sys.exit(f"mutate.py: the unmutated project fails its own tests ({why}); a "
                         "failing test kills nothing")
        outcomes = []
        for m in mutations:
            t0 = time.monotonic()
            texts = patched_texts(copy, m)
            if isinstance(texts, str):
                outcomes.append(Outcome(m, "stale", texts))
                progress(f"{m.name}: stale ({texts})")
                continue
            try:
                for path, (_, patched) in texts.items():
                    path.write_text(patched)
                rc, out = run_tests(copy, m.tests, timeout)
                if rc is None:  # where it hung, then once more: a hang of the machine's
                    # (not the mutation's) must not fail CI; the mutation's hangs twice
                    progress(f"{m.name}: no answer in {timeout:.0f} s; output's end:\n"
                             + out[-4000:])
                    rc, out = run_tests(copy, m.tests, timeout)
            finally:
                for path, (original, _) in texts.items():
                    path.write_text(original)
            secs = time.monotonic() - t0
            if rc is None:
                o = Outcome(m, "timeout", f"no answer in {timeout:.0f} s", secs)
            elif rc == 1:
                o = Outcome(m, "killed", first_failure(out) or "(a test failed)", secs)
            elif rc == 0 and m.equivalent:
                o = Outcome(m, "equivalent", m.equivalent, secs)
            elif rc == 0:
                o = Outcome(m, "SURVIVED", "", secs)
            else:
                o = Outcome(m, "error", f"pytest exit {rc}: {first_failure(out)}", secs)
            outcomes.append(o)
            progress(f"{m.name}: {o.status} {o.by} ({secs:.1f} s)")
        return outcomes


def table(outcomes: list[Outcome], markdown: bool) -> str:
    rows = [(o.mutation.name, o.status, o.by, f"{o.seconds:.1f}") for o in outcomes]
    head = ("mutation", "killed", "by which test", "s")
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += [f"| `{r[0]}` | " + " | ".join(r[1:]) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(r[k])) for r in rows + [head]) for k in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*r) for r in [head] + rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fast", action="store_true", help="only the CI subset")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run only this mutation (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per mutation's test run (default 300; 150 with --fast, "
                    "whose slowest takes ~25 s)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the unmutated run of the tests: only for a caller that runs "
                    "the same tests unmutated itself and fails if they fail (the CI suite, "
                    "tests/test_mutation_fast.py)")
    args = ap.parse_args(argv)
    if args.timeout is None:
        args.timeout = 150.0 if args.fast else 300.0
    chosen = [m for m in MUTATIONS if (not args.fast or m.fast)
              and (not args.only or m.name in args.only)]
    unknown = set(args.only) - {m.name for m in MUTATIONS}
    if unknown:
        ap.error(f"unknown mutation(s): {', '.join(sorted(unknown))}")
    if args.list:
        for m in chosen:
            files = ", ".join(sorted({p.file for p in m.patches}))
            print(f"{m.name}{' (fast)' if m.fast else ''}: {m.what}\n    files: {files}\n"
                  f"    tests: {' '.join(m.tests)}")
        return 0
    t0 = time.monotonic()
    outcomes = run(chosen, args.timeout, lambda msg: print(msg, file=sys.stderr, flush=True),
                   baseline=not args.no_baseline)
    print(table(outcomes, args.markdown))
    bad = [o for o in outcomes if not o.ok]
    print(f"\n{len(outcomes) - len(bad)} of {len(outcomes)} mutations killed in "
          f"{time.monotonic() - t0:.0f} s" + (f"; not killed: {', '.join(o.mutation.name for o in bad)}"
                                              if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
