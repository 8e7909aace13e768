"""The conformance suite: a correct backend passes everything, each simulated defect is caught."""
from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from driftcheck.cli import probe_main
from driftcheck.errors import DriftcheckError
from driftcheck.probe import PROGRAMS, ProbeResult, run_probe
from driftcheck.targets import simulate

VIEW_WRITES = {  # writes through a view: both view defects must break them
    "index_assign_int", "index_assign_slice", "index_assign_strided_slice", "slice_view_write",
    "select_view_write", "narrow_view_write", "transpose_view_write", "permute_view_write",
    "view_write", "reshape_contiguous_aliases", "diagonal_write", "as_strided_write",
    "chunk_write", "split_sizes_write", "unbind_write", "masked_fill_view", "copy_row_to_row",
    "copy_into_transposed", "out_add_into_view", "out_mm_into_view",
    "foreach_add_on_flat_buffer_views", "version_counter_shared_with_view",
}
NO_VIEW_INVOLVED = {  # no write through a view: no view defect may touch them
    "index_assign_bool_mask", "index_put_accumulate", "masked_fill_base", "scatter_inplace",
    "clone_does_not_alias", "reshape_noncontiguous_copies", "contiguous_of_transposed_copies",
    "foreach_add_", "foreach_mul_", "foreach_lerp_", "sgd_step_updates_params", "data_inplace",
    "leaf_inplace_under_no_grad", "batchnorm_buffers_update", "batchnorm_buffers_cumulative",
}


def _by_status(results):
    assert all(isinstance(r, ProbeResult) for r in results)
    return {status: {r.name for r in results if r.status == status}
            for status in ("pass", "mismatch", "error")}


@pytest.fixture(scope="module")
def correct():
    return run_probe("cpu")


def test_cpu_against_cpu_passes_everything(correct):
    assert len(PROGRAMS) >= 40 and [r.name for r in correct] == list(PROGRAMS)
    assert [r for r in correct if not r] == []
    assert VIEW_WRITES | NO_VIEW_INVOLVED <= set(PROGRAMS)


def test_programs_report_alias_facts():
    facts = PROGRAMS["slice_view_write"](torch.device("cpu"))
    assert facts["v_is_view"] is True and facts["base_changed"] is True
    assert PROGRAMS["expand_inplace_raises"](torch.device("cpu"))["raised"] is True
    assert PROGRAMS["clone_does_not_alias"](torch.device("cpu"))["shares"] is False


def test_views_become_copies_is_caught():
    s = _by_status(run_probe("cpu", fault=simulate.views_become_copies))
    assert not s["error"]
    assert VIEW_WRITES <= s["mismatch"]
    # Read-only views are caught by their alias facts (strides, sharing), not by values.
    assert {"expand_read", "unfold_read", "base_write_seen_by_view",
            "expand_inplace_raises"} <= s["mismatch"]
    assert NO_VIEW_INVOLVED <= s["pass"]


def test_dropped_view_writes_are_caught():
    s = _by_status(run_probe("cpu", fault=simulate.drop_view_writes))
    assert not s["error"]
    assert VIEW_WRITES <= s["mismatch"]
    # Views themselves are still real: reading through them and writing the base still work.
    assert {"expand_read", "unfold_read", "base_write_seen_by_view",
            "expand_inplace_raises"} <= s["pass"]
    assert NO_VIEW_INVOLVED <= s["pass"]


def test_skipped_batchnorm_updates_are_caught():
    s = _by_status(run_probe("cpu", fault=simulate.skip_batchnorm_stat_updates))
    assert s["mismatch"] == {"batchnorm_buffers_update", "batchnorm_buffers_cumulative"}
    assert not s["error"]
    detail = next(r.detail for r in run_probe("cpu", fault=simulate.skip_batchnorm_stat_updates)
                  if r.name == "batchnorm_buffers_update")
    assert "running_mean" in detail and "num_batches_tracked" not in detail


def test_probe_main_table_json_and_exit_code(tmp_path):
    out = io.StringIO()
    path = tmp_path / "probe.json"
    assert probe_main("cpu", str(path), console=Console(file=out, width=200)) == 0
    doc = json.loads(path.read_text())
    assert doc["schema"] == "driftcheck.probe/1" and doc["passed"] == doc["total"] == len(PROGRAMS)
    assert "index_assign_int" in out.getvalue()
    out = io.StringIO()
    code = probe_main("cpu", console=Console(file=out, width=200),
                      fault=simulate.skip_batchnorm_stat_updates)
    assert code == 1 and "mismatch" in out.getvalue()


@pytest.mark.parametrize("device", ["no_such_device", "cuda:7"])
def test_unusable_device_is_a_user_error(device):
    with pytest.raises(DriftcheckError, match="not usable here"):
        run_probe(device)


# -- the real lazy-tensor backend (torch._lazy, in the CPU wheel) ------------------------------
# Measured on torch 2.13 (docs/findings.md): storage facts are not observable there (no storage,
# strides of a contiguous tensor, views functionalized), values are; these are the programs whose
# values the backend gets wrong, or that raise on it.
LAZY_CASES = {
    "index_assign_int": "pass", "slice_view_write": "pass", "transpose_inplace": "pass",
    # t() reports contiguous strides, so .contiguous() / reshape() return views, not copies
    "contiguous_of_transposed_copies": "mismatch", "reshape_noncontiguous_copies": "mismatch",
    "expand_inplace_raises": "mismatch",  # no internal-overlap check: the writes sum into x
    "chunk_write": "error",  # a write through a split/chunk/unbind output raises
    "batchnorm_buffers_update": "mismatch",  # running stats never written
}


def test_probe_runs_on_lazy_and_says_what_it_cannot_observe(monkeypatch, tmp_path):
    import driftcheck.probe

    monkeypatch.setattr(driftcheck.probe, "PROGRAMS", {k: PROGRAMS[k] for k in LAZY_CASES})
    out = io.StringIO()
    path = tmp_path / "lazy.json"
    assert probe_main("lazy", str(path), console=Console(file=out, width=250)) == 1
    doc = json.loads(path.read_text())
    results = {r["name"]: r for r in doc["results"]}
    assert {k: r["status"] for k, r in results.items()} == LAZY_CASES
    assert "not observable on lazy" in results["slice_view_write"]["detail"]
    assert "not observable" not in results["index_assign_int"]["detail"]
    assert "not a lazy tensor" in results["chunk_write"]["detail"]
    assert "x: values differ" in results["contiguous_of_transposed_copies"]["detail"]
    assert "slice_view_write" in out.getvalue() and doc["device"] == "lazy"
