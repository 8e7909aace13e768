"""The tracer's parts, each alone: the calls open, the selection, the two configs, the capture,
the watch's log, the norm audit, the state captures and the gradient taps."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from driftcheck.record.audits import NormAudit
from driftcheck.record.autograd import BackwardHooks
from driftcheck.record.calls import Calls, call_label
from driftcheck.record.capture import Capture
from driftcheck.record.config import CaptureConfig, RecordConfig
from driftcheck.record.selection import Selection
from driftcheck.record.state import StateCapture, parameter_owners, tied_parameters
from driftcheck.record.tapping import TapGradients
from driftcheck.record.watch import LOSS_CODE, WatchLog
from driftcheck.store.writer import TraceWriter


def _capture(tmp_path: Path, **config: object) -> tuple[Capture, TraceWriter]:
    cfg = CaptureConfig(**config)  # type: ignore[arg-type]
    writer = TraceWriter(tmp_path / "t", force=True)
    return Capture(writer, Selection(cfg), cfg), writer


# -- calls ----------------------------------------------------------------------------------------
def test_calls_number_each_module_and_know_the_enclosing_call():
    calls = Calls()
    assert calls.open("") == (0, None)
    assert calls.open("a") == (0, ("", 0))
    assert calls.close("a") == ("a", 0)
    assert calls.open("a") == (1, ("", 0))  # the second call of "a" within the step
    assert calls.current_module == "a" and calls.top == ("a", 1) and calls.count("a") == 2
    calls.close("a"), calls.close("")
    assert calls.top is None and calls.current_module == ""
    assert calls.close("x") == ("x", 0)  # nothing open: the call a post-hook names
    calls.reset()
    assert calls.count("a") == 0
    assert call_label(("a.b", 3)) == "a.b#3" and call_label(None) is None


def test_calls_ignore_hooks_while_paused_or_replaying():
    calls = Calls()
    assert not calls.ignored
    calls.paused = True
    assert calls.ignored
    calls.paused, calls.replaying = False, True
    assert calls.ignored


# -- selection and configs ------------------------------------------------------------------------
def test_selection_include_then_exclude_and_the_phases_it_implies():
    sel = Selection(CaptureConfig(include=("layers.*",), exclude=("layers.1*",), phases={"backward"},
                                  steps={0, 2}))
    assert sel.module("layers.0.fc") and not sel.module("layers.1.fc") and not sel.module("head")
    assert sel.phase("backward", 0) and not sel.phase("backward", 1)  # step 1 not chosen
    assert not sel.phase("forward", 0) and not sel.phase("loss", 0)  # the loss goes with forward
    assert not sel.phase("params", 0)  # params go with forward or optimizer
    assert Selection(CaptureConfig(phases={"optimizer"})).phase("params", 5)
    assert Selection(CaptureConfig(phases=frozenset())).phases == {"forward", "backward", "grads", "optimizer"}


@pytest.mark.parametrize("mode,full", [("full", [True, True]), ("stats", [False, False]),
                                       ("auto", [True, False])])
def test_selection_full_tensors_by_mode(mode, full):
    sel = Selection(CaptureConfig(mode=mode, full_modules=("head*",)))
    assert [sel.full("head.fc"), sel.full("body")] == full


def test_capture_config_normalizes_and_refuses_a_bad_mode():
    cfg = CaptureConfig(include=["a"], phases=["forward", "forward"], steps=[1, 1, 0])  # type: ignore[arg-type]
    assert cfg.include == ("a",) and cfg.phases == {"forward"} and cfg.steps == {0, 1}
    with pytest.raises(ValueError, match="mode must be one of"):
        CaptureConfig(mode="everything")


def test_record_config_carries_the_capture_and_the_run_s_changes():
    cfg = RecordConfig("out", mode="stats", include=["x*"], capture_steps=[0], seed=3, transfer="per-capture",
                       view_audit=True, env={"A": "1"})  # type: ignore[arg-type]
    cap = cfg.capture(phases={"forward"}, seed=7)
    assert cap == CaptureConfig(mode="stats", include=("x*",), phases=frozenset({"forward"}),
                                steps=frozenset({0}), transfer="per-capture", seed=7, view_audit=True)
    assert cfg.replace(out="elsewhere").out == "elsewhere" and cfg.out == "out"
    with pytest.raises(AttributeError):
        cfg.mode = "full"  # type: ignore[misc]  # frozen


def test_record_takes_a_config_or_the_same_keywords(tmp_path):
    from driftcheck.loader import load_scenario
    from driftcheck.record.runner import record
    from driftcheck.store import TraceReader

    a = record(load_scenario("mlp"), RecordConfig(tmp_path / "a", steps=1, mode="stats", model_id="mlp"))
    b = record(load_scenario("mlp"), tmp_path / "b", steps=1, mode="stats", model_id="mlp")
    ra, rb = TraceReader(a), TraceReader(b)
    assert [(e["key"], e["stats"]) for e in ra.entries] == [(e["key"], e["stats"]) for e in rb.entries]
    with pytest.raises(TypeError, match="not both"):
        record(load_scenario("mlp"), RecordConfig(tmp_path / "c"), steps=1)


# -- capture --------------------------------------------------------------------------------------
def test_capture_copies_at_hook_time_numbers_the_order_and_takes_a_key_once(tmp_path):
    cap, writer = _capture(tmp_path)
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    cap("m", "forward", 0, "output.0", t)
    t.add_(100)  # an in-place op after the hook: not in the capture
    cap("m", "forward", 0, "output.0", t)  # the same key again: ignored
    cap.step = 4
    cap("m", "forward", 1, "output.0", t)
    assert len(cap.pending) == 2 and cap.order == 2
    cap.flush()
    assert cap.pending == [] and cap.pending_bytes == 0
    first, second = writer.entries
    assert first["key"] == "0/forward/m/0/output.0" and first["order"] == 0
    assert second["key"] == "4/forward/m/1/output.0" and second["step"] == 4
    assert first["stats"]["max"] == 5.0 and second["stats"]["min"] == 100.0
    assert cap.wants("forward") and not _capture(tmp_path, steps={1})[0].wants("forward")
    writer.abort("test")


def test_capture_reset_starts_the_step_s_order_and_hands_back_its_summaries(tmp_path):
    cap, writer = _capture(tmp_path, mode="stats")
    big = torch.randn(1 << 17)  # summarised at hook time (stats mode, a large tensor)
    cap("m", "params", 0, "param.w", big)
    known = cap.reset()
    assert cap.order == 0 and id(big) in known
    cap("m", "params", 0, "param.w", big)  # a new step: the key may be taken again
    assert len(cap.pending) == 2
    writer.abort("test")


# -- watch log ------------------------------------------------------------------------------------
def test_watch_log_keys_values_by_the_open_call_and_the_loss_code():
    calls = Calls()
    log = WatchLog(calls)
    log.on_logits(torch.tensor(3.0))  # inactive: nothing kept
    assert log.logits == {}
    calls.active = True
    log.on_logits(torch.tensor(3.0))  # outside any module: the loss code's
    calls.open("attn")
    log.on_logits(torch.tensor(2.0))
    log.on_logits(torch.tensor(5.0))
    log.on_ctc(7)
    log.on_rounding(torch.tensor([1, 0]))
    log.on_rounding(torch.tensor([1, 1]))
    log.on_host()
    watched = log.take(("attn", 0))
    assert float(watched.logit_absmax) == 5.0 and watched.ctc_frames == 7 and watched.host_decisions == 1
    assert watched.roundings.tolist() == [2, 1] and watched.decisions is None
    assert log.take(("attn", 0)).logit_absmax is None  # taken once
    assert float(log.take(LOSS_CODE).logit_absmax) == 3.0
    calls.replaying = True
    log.on_host()
    assert log.host_decisions == {}


# -- norm audit -----------------------------------------------------------------------------------
def test_norm_audit_finds_a_batchnorm_that_never_updates_its_running_stats(tmp_path):
    cap, writer = _capture(tmp_path)
    findings: list[dict] = []
    audit = NormAudit(True, cap, findings)
    bn = nn.BatchNorm1d(4).train()
    x = torch.randn(8, 4) * 3 + 1
    audit.enter("bn", 0, bn, x, compiled=False)
    bn(x)
    audit.leave("bn", 0, bn)
    assert findings == []  # a correct BatchNorm
    audit.enter("bn", 1, bn, x, compiled=False)
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    bn(x)
    bn.load_state_dict(before)  # a backend that never writes the running statistics
    audit.leave("bn", 1, bn)
    assert findings and findings[0]["module"] == "bn"
    off = NormAudit(False, cap, [])
    off.enter("bn", 0, bn, x, compiled=True)
    assert off.deferred == []
    writer.abort("test")


# -- state captures -------------------------------------------------------------------------------
class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(1))


def test_state_capture_names_each_parameter_under_its_owner_once(tmp_path):
    model = _Tied()
    owners = parameter_owners(model)
    assert owners[id(model.emb.weight)][:2] == ("emb", "weight")
    names = {m: n for n, m in model.named_modules()}
    assert tied_parameters(names, owners) == [
        {"module": "head", "param": "weight", "owner": "emb", "owner_param": "weight"}]
    cap, writer = _capture(tmp_path)
    state = StateCapture(model, cap, lambda name: True, optimizer=None)
    assert state.owner(model.head.weight) == ("emb", "weight") and state.owner(torch.ones(1)) is None
    state.params("params")
    assert [p.entry["key"] for p in cap.pending] == ["0/params/./0/buffer.scale",
                                                     "0/params/emb/0/param.weight"]
    state.after_update()
    state.after_update()  # once a step
    assert [p.entry["phase"] for p in cap.pending].count("optimizer") == 2
    writer.abort("test")


# -- gradient taps and the backward ---------------------------------------------------------------
def test_tap_gradients_claim_the_outputs_a_forward_tap_hooked(tmp_path):
    cap, writer = _capture(tmp_path)
    calls = Calls()
    taps = TapGradients(cap, calls, lambda name: name != "skipped")
    y = torch.ones(2)
    taps.hooked(("m", 0), ["output.0"], [y])
    assert taps.claim("m", 0, {"kind": "linear"}) == {"output.0"}
    assert taps.contexts[("m", 0)] == {"kind": "linear"} and taps.claim("m", 0, {}) == set()
    calls.active = True
    taps.on_grad("m", 0, "grad_output.0", torch.full((2,), 2.0))
    taps.on_grad("skipped", 0, "grad_output.0", torch.ones(2))  # not selected
    taps.on_grad("m", -1, "grad_output.0", torch.ones(2))  # no call was taken
    assert [(p.entry["key"], p.entry.get("meta")) for p in cap.pending] == [
        ("0/backward/m/0/grad_output.0", {"kind": "linear"})]
    writer.abort("test")


def test_backward_hooks_capture_a_call_s_input_gradient_off_its_own_edges(tmp_path):
    cap, writer = _capture(tmp_path)
    calls = Calls()
    calls.active = True
    backward = BackwardHooks(cap, calls, TapGradients(cap, calls, lambda n: True), compiled=False,
                             root_output_grads=True)
    x = torch.randn(3, requires_grad=True)
    h = x * 2  # made before the call: its node is the input's
    backward.open(("f", 0), [("input.0", h)])
    y = (h * 3).sum()
    backward.hook("f", 0, [("output", y)], {"kind": "other"}, backward.made_by("f", 0, [("output", y)]))
    y.backward()
    grads = {p.entry["slot"]: p.tensor for p in cap.pending}
    assert torch.equal(grads["grad_input.0"], torch.full((3,), 3.0))
    assert torch.equal(grads["grad_output"], torch.tensor(1.0))
    assert backward.next_sequence_nr() > 0
    writer.abort("test")
