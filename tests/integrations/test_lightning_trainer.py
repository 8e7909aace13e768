"""A real Lightning Trainer (CPU, in-memory data) traced by the callback: an fp32 reference
against a bf16-mixed target that replays it, with accumulation, dropout and validation between
the traced steps."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from driftcheck.compare import compare
from driftcheck.errors import DriftcheckError
from driftcheck.integrations.lightning import DriftcheckCallback
from driftcheck.store import TraceReader
from driftcheck.targets import faults

FAULTY = "net.3"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's advice on toy loaders


class Net(L.LightningModule):
    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(dropout), nn.Linear(32, 32),
                                 nn.LayerNorm(32), nn.Linear(32, 4))

    def training_step(self, batch, idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(tmp, out, *, replay=None, precision="32-true", accumulation=2, seed=0, fault=None,
         steps=2, callback=True, dropout=0.1, max_steps=4, **kw):
    torch.manual_seed(seed)
    module = Net(dropout)
    if fault:
        faults.scale_output(FAULTY, fault)(module)
    g = torch.Generator().manual_seed(seed + 1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g),
                                          torch.randint(0, 4, (64,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True,
                                         generator=torch.Generator().manual_seed(seed))
    cb = DriftcheckCallback(tmp / out, steps=steps, replay=replay, force=True, **kw) if callback else None
    L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, precision=precision,
              accumulate_grad_batches=accumulation, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, val_check_interval=2,
              limit_val_batches=2, num_sanity_val_steps=1,
              callbacks=[cb] if cb else None).fit(module, loader, loader)
    return module, cb


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lightning")
    _fit(tmp, "ref")
    return tmp, tmp / "ref"


def test_reference_holds_the_chosen_steps_and_no_validation_call(ref):
    _, path = ref
    r = TraceReader(path)
    assert r.run["steps"] == 2 and r.run["driver"] == "lightning.Trainer"
    forward = [e for e in r.entries if e["module"] == "net.0" and e["phase"] == "forward"
               and e["slot"] == "output"]
    # 2 steps x 2 accumulated batches; the sanity check and validation calls are not steps
    assert sorted((e["step"], e["call"]) for e in forward) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert any(e["phase"] == "loss" for e in r.entries)


def test_fp32_replay_is_bitwise_from_other_weights_and_data(ref):
    tmp, path = ref
    _fit(tmp, "same", replay=path, seed=5)
    rep = compare(path, tmp / "same")
    assert rep and max(e.ratio for e in rep.entries if e.ratio is not None) == 0


def test_bf16_mixed_target_passes_and_a_fault_is_caught_at_its_module(ref):
    tmp, path = ref
    _fit(tmp, "bf16", replay=path, precision="bf16-mixed", seed=5)
    rep = compare(path, tmp / "bf16")
    assert rep, rep.decided_by
    assert TraceReader(tmp / "bf16").run["autocast"] == "bf16"
    _fit(tmp, "fault", replay=path, precision="bf16-mixed", seed=5, fault=1.2)
    bad = compare(path, tmp / "fault")
    assert not bad
    assert bad.first_divergence["module"] == FAULTY and bad.first_divergence["phase"] == "forward"


def test_tracing_does_not_change_the_training(tmp_path):
    traced, _ = _fit(tmp_path, "t", dropout=0.0)
    plain, _ = _fit(tmp_path, "u", dropout=0.0, callback=False)
    for (n, a), (_, b) in zip(traced.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), n
    assert "training_step" not in traced.__dict__  # the callback put the module back


def test_stop_ends_training_after_the_traced_steps(tmp_path):
    _, cb = _fit(tmp_path, "stop", steps=1, stop=True, max_steps=50)
    assert cb.session.done and TraceReader(tmp_path / "stop").run["steps"] == 1


def test_a_target_with_other_accumulation_is_refused(ref):
    tmp, path = ref
    with pytest.raises(DriftcheckError, match="gradient accumulation"):
        _fit(tmp, "acc", replay=path, accumulation=1)
    assert not (tmp / "acc" / "manifest.json").exists()  # never passes as a complete trace


def test_bad_arguments_are_refused_before_training(tmp_path):
    with pytest.raises(DriftcheckError, match="mode must be one of"):
        DriftcheckCallback(tmp_path / "x", mode="bogus")
    with pytest.raises(DriftcheckError, match="steps must be"):
        DriftcheckCallback(tmp_path / "x", steps="two")
