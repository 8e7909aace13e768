"""PyTorch's lazy-tensor backend (TorchScript-lowered, in every CPU wheel) as a real deferred
target: the device opens, a trace captures without splitting the step's graph, and the traced
run computes bitwise what the untraced one does."""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import driftcheck
from driftcheck.errors import DriftcheckError
from driftcheck.targets import deferred, devices

pytestmark = pytest.mark.skipif(not deferred.lazy_available(), reason="no lazy-tensor backend")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _train(out=None, mode="full", transfer="batched"):
    """2 SGD steps on lazy; the losses, the parameters after, each step's counters."""
    dev = devices.open_device("lazy")
    model = _model().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    xs = [torch.randn(4, 8) for _ in range(2)]
    losses, counts = [], []
    before = deferred.counters("lazy")

    def step(x):
        loss = model(x.to(dev)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    if out is None:
        for x in xs:
            loss = step(x)
            deferred.mark_step(dev)
            losses.append(loss.cpu())
            now = deferred.counters("lazy")
            counts.append(deferred.diff(now, before))
            before = now
    else:
        with driftcheck.trace(model, out=str(out), mode=mode, optimizer=opt, transfer=transfer) as t:
            for x in xs:
                loss = step(x)
                t.step(loss)
                losses.append(loss.cpu())
    return losses, [p.detach().cpu() for p in model.parameters()], counts


def test_lazy_opens_and_unknown_types_name_the_registered_ones():
    assert devices.open_device("lazy") == torch.device("lazy")
    assert "lazy" in devices.registered_types()
    with pytest.raises(DriftcheckError, match=r"unknown device type 'nosuch': this torch .* has cpu, .*lazy"):
        devices.open_device("nosuch")
    with pytest.raises(DriftcheckError, match="has cpu"):
        devices.open_device("hpu")  # known to torch, no backend here


def test_cli_unknown_device_is_one_line_exit_2(tmp_path):
    got = subprocess.run([sys.executable, "-m", "driftcheck", "record", "mlp", "--out",
                          str(tmp_path / "t"), "--device", "nosuch"], capture_output=True, text=True)
    assert got.returncode == 2
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown device type 'nosuch'" in lines[0] and "lazy" in lines[0]


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_trace_on_lazy_is_bitwise_the_untraced_run(tmp_path, mode):
    losses, params, untraced = _train()
    t_losses, t_params, _ = _train(tmp_path / "t", mode=mode)
    for a, b in zip(losses + params, t_losses + t_params):
        assert torch.equal(a, b)
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    lazy = manifest["run"]["lazy"]
    assert lazy["capture_graphs"] == [0, 0]  # no sync point of the capture's own
    # one graph a step, traced as untraced (the traced one has the captures as more outputs)
    for traced, plain in zip(lazy["steps"], untraced):
        assert deferred.graphs(traced) == deferred.graphs(plain) == 1
        assert traced["MarkStep"] == plain["MarkStep"] == 1
    assert not [f for f in manifest["findings"] if f["kind"] == "deferred.capture_sync"]
    assert len(manifest["entries"]) > 40


def test_a_sync_point_of_the_capture_is_a_finding(tmp_path):
    _train(tmp_path / "t", transfer="per-capture")  # every capture read at once: a sync each
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    found = [f for f in manifest["findings"] if f["kind"] == "deferred.capture_sync"]
    assert [f["step"] for f in found] == [0, 1]
    assert all(n > 0 for n in manifest["run"]["lazy"]["capture_graphs"])


def test_run_mlp_cpu_against_lazy_passes(tmp_path):
    got = subprocess.run([sys.executable, "-m", "driftcheck", "--quiet", "run", "mlp", "--reference",
                          "cpu", "--target", "lazy", "--out", str(tmp_path / "run"), "--steps", "2"],
                         capture_output=True, text=True)
    assert got.returncode == 0, got.stderr[-2000:]


def _bn_run(dev, out=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4)).to(dev)
    deferred.mark_step(dev)  # the buffers hold device data, as after any step
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    xs = [torch.randn(16, 8) for _ in range(2)]
    means = []
    with driftcheck.trace(model, out=str(out), optimizer=opt) if out else contextlib.nullcontext() as t:
        for x in xs:
            loss = model(x.to(dev)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            t.step(loss) if t is not None else deferred.mark_step(dev)
            means.append(float(model[1].running_mean.abs().max().cpu()))
    return means


def test_lazy_batchnorm_buffers_are_read_after_the_sync_point(tmp_path):
    """The lazy backend updates BatchNorm's running statistics in place in the device data,
    unordered with a read of them in the same graph: a capture in the step saw the value before
    the update (and the audit called the update lost). Buffers after the update are captured,
    and audited, after the step's mark_step: the values the untraced run has."""
    dev = devices.open_device("lazy")
    untraced = _bn_run(dev)
    assert _bn_run(dev, tmp_path / "t") == untraced and untraced[0] > 0
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert not [f for f in manifest["findings"] if f["kind"].startswith("batchnorm")]
    mean = {(e["step"], e["phase"]): e["stats"]["absmax"] for e in manifest["entries"]
            if e["module"] == "1" and e["slot"] == "buffer.running_mean"}
    assert mean[(0, "params")] == 0.0
    assert [mean[(0, "optimizer")], mean[(1, "optimizer")]] == pytest.approx(untraced, rel=1e-6)
    assert mean[(1, "params")] == mean[(0, "optimizer")]
    assert manifest["run"]["lazy"]["capture_graphs"] == [0, 0]


def test_backend_defect_is_one_line(tmp_path):
    got = subprocess.run([sys.executable, "-m", "driftcheck", "--quiet", "record", "vit", "--device",
                          "lazy", "--steps", "1", "--out", str(tmp_path / "t")],
                         capture_output=True, text=True)
    assert got.returncode == 2
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and "a defect of the lazy backend, not of the model" in lines[0]
