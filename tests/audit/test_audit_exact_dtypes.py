"""Writes through views into integer and bool tensors are judged exactly: token ids, labels and
masks are right or wrong, whatever floating tolerance the comparison was given."""
from __future__ import annotations

import contextlib

import pytest
import torch

from driftcheck.audit.views import ViewAudit, compare_events
from driftcheck.targets.simulate import drop_view_writes

BIG = 2**60  # int64 values a float64 checksum cannot tell apart from BIG + 1


def _labels(last=-100, *, offset=0, dtype=torch.int64, fault=None, first=None):
    """labels = ids.clone(); labels[:, -1] = last; labels[:, :2].masked_fill_(...): as in LM code."""
    audit = ViewAudit(lambda: "loss")
    ids = (torch.arange(40, dtype=torch.int64).reshape(4, 10) * 1000 + offset).to(dtype)
    if first is not None:
        ids[0, 3] = first  # an upstream difference, before any audited write
    with fault() if fault else contextlib.nullcontext():
        with audit:
            labels = ids.clone()
            labels[:, -1] = last
            head = labels[:, :2]
            head.masked_fill_(head > offset + 5000, offset + 7)
    return audit.events()


def _loose(r, t):
    return 0.03  # a bf16-level tolerance, as from a callable tolerance


@pytest.mark.parametrize("tolerance", [None, 0.0, 0.03, _loose])
def test_the_same_ints_written_give_no_finding(tolerance):
    assert compare_events(_labels(), _labels(), tolerance) == []
    assert compare_events(_labels(offset=BIG), _labels(offset=BIG), tolerance) == []


@pytest.mark.parametrize("tolerance", [0.03, _loose, 0.5])
def test_one_different_int_is_named_whatever_the_tolerance(tolerance):
    found = compare_events(_labels(-100), _labels(-99), tolerance)
    assert {f.kind for f in found} == {"inplace.value_mismatch"}, [f.message for f in found]
    assert found[0].details["op"].startswith("aten.fill_") and found[0].details["tolerance"] == 0


def test_ints_beyond_2_53_are_compared_exactly():
    found = compare_events(_labels(BIG, offset=BIG), _labels(BIG + 1, offset=BIG), 0.0)
    assert {f.kind for f in found} == {"inplace.value_mismatch"}
    fill = next(e for e in _labels(BIG, offset=BIG) if e["op"].startswith("aten.fill_"))
    assert all(isinstance(v, int) for v in fill["value"].values())  # an exact integer checksum


def test_a_write_changing_big_ints_by_one_changes_the_base():
    # BIG + 1 rounds to BIG in float64: a float checksum sees no change and cannot say it was lost.
    def bump(fault=None):
        audit = ViewAudit(lambda: "m")
        ids = torch.full((4, 10), BIG, dtype=torch.int64)
        with fault() if fault else contextlib.nullcontext(), audit:
            ids[:, -1] += 1
        return audit.events()

    add = next(e for e in bump() if e["op"].startswith("aten.add_"))
    assert add["base_changed"] is True  # float64 of BIG and BIG + 1 are equal: the int path sees it
    found = compare_events(bump(), bump(drop_view_writes), 0.03)
    assert "inplace.base_not_updated" in {f.kind for f in found}


def test_bool_masks_are_exact():
    def mask(value):
        audit = ViewAudit(lambda: "m")
        m = torch.ones(8, 50, dtype=torch.bool)
        with audit:
            m[:, 0] = value
            m[1, 1] = True
        return audit.events()

    assert compare_events(mask(True), mask(True), _loose) == []
    found = compare_events(mask(True), mask(False), _loose)  # 8 of 400 bools: 2% of the sum
    assert {f.kind for f in found} == {"inplace.value_mismatch"}


def test_ints_that_differed_before_the_write_are_not_its_doing():
    # The base already differed (an upstream op, another RNG stream): the write did the same
    # thing on both sides, so it is not named; the numeric comparison owns the upstream drift.
    assert compare_events(_labels(first=5), _labels(first=6), 0.0) == []
    assert compare_events(_labels(first=5), _labels(first=6), _loose) == []
