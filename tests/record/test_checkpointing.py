"""Gradient checkpointing (torch.utils.checkpoint, the default non-reentrant kind that Hugging
Face's gradient_checkpointing_enable uses): its region's forward runs again inside the backward,
and the non-reentrant kind counts and checks every tensor the region saves. The local replay of
a module inside such a region must not save tensors of its own there (it did: a CheckpointError
in the replay, and the recomputation's calls recorded on the target only, a clean bf16 run
failing at alignment.extra_in_target). A defect in a checkpointed block is still caught and
blamed on it."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from driftcheck import Scenario
from driftcheck.compare import compare
from driftcheck.record.runner import record
from driftcheck.store import TraceReader
from driftcheck.targets import opfaults


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.gate, self.down = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(self.up(x) * torch.sigmoid(self.gate(x)))


class _Net(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.reentrant = reentrant

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=self.reentrant)
        return self.out(h)


def _scenario(reentrant: bool) -> Scenario:
    torch.manual_seed(0)
    return Scenario(model=_Net(reentrant), inputs=[torch.randn(16, 8), torch.randn(16, 8)],
                    loss=lambda out, batch: out.pow(2).mean(),
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), steps=2)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_model_records_its_local_replay_and_passes_clean(tmp_path, reentrant):
    record(_scenario(reentrant), tmp_path / "ref")
    record(_scenario(reentrant), tmp_path / "t", dtype="bf16", replay=tmp_path / "ref", local=tmp_path / "ref")
    rep = compare(tmp_path / "ref", tmp_path / "t")
    assert rep.verdict == "pass", rep.decided_by
    assert not [f for f in rep.findings if f.kind.startswith(("alignment.", "local."))], rep.findings
    slots = {(e["module"], e["slot"]) for e in TraceReader(tmp_path / "t").entries}
    assert ("blocks.1.down", "local.output") in slots and ("blocks.1", "local.output") in slots


def test_a_defect_in_a_checkpointed_block_is_caught_and_blamed_on_it(tmp_path):
    record(_scenario(False), tmp_path / "ref")
    fault = opfaults.scale_op("blocks.1", "mul", 1.05)
    try:
        record(_scenario(False), tmp_path / "t", dtype="bf16", replay=tmp_path / "ref",
               local=tmp_path / "ref", target_hooks=fault)
    finally:
        fault.remove()
    rep = compare(tmp_path / "ref", tmp_path / "t")
    assert rep.verdict == "fail"
    assert rep.first_divergence["blame_module"] == "blocks.1"
