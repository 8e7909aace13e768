"""Which precision settings differ between two runs, and which differences explain drift."""
from __future__ import annotations

import copy

import torch

from driftcheck.targets.precision import capture_settings
from driftcheck.targets.settings_diff import diff_settings, explains_drift


def test_diff_settings_flags_what_explains_drift() -> None:
    ref = capture_settings(torch.device("cpu"), torch.float32)
    tgt = copy.deepcopy(ref)
    assert diff_settings(ref, tgt) == []
    tgt["dtype"] = "bfloat16"
    tgt["host"]["node"] = "tpu-vm-7"
    tgt["threads"] = ref["threads"] + 3
    tgt["device"] = {"type": "tpu", "index": 0}
    tgt["env"]["TORCH_TPU_DEFER_AND_FUSE"] = "1"
    tgt["fp8"] = {"format": "hybrid", "scaling": "delayed"}
    tgt["versions"]["torch_tpu"] = "0.2.0"
    rows = {key: (a, b, explains) for key, a, b, explains in diff_settings(ref, tgt)}
    assert rows["dtype"] == ("float32", "bfloat16", True)
    assert rows["host.node"][2] is False
    assert rows["threads"][2] is True  # reduction order
    assert rows["device.type"] == ("cpu", "tpu", True)
    assert rows["device.index"] == (None, 0, False)
    assert rows["env.TORCH_TPU_DEFER_AND_FUSE"] == (None, "1", True)
    assert rows["fp8"] == (None, {"format": "hybrid", "scaling": "delayed"}, True)  # one row
    assert rows["versions.torch_tpu"] == (None, "0.2.0", True)
    assert "device.name" in rows  # removed on the target side: reported, not dropped
    keys = [row[0] for row in diff_settings(ref, tgt)]
    assert keys == sorted(keys)


def test_explains_drift_by_dotted_prefix() -> None:
    assert explains_drift("dtype") and explains_drift("env.XLA_FLAGS")
    assert not explains_drift("host.node") and not explains_drift("device.index")
    assert explains_drift("host.nodes")  # a prefix is a whole dotted part, not a substring
