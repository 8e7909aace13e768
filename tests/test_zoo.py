"""A slice of the calibration corpus (bench/zoo.py): three third-party architectures from
transformers and diffusers (CI installs neither torchvision nor timm) through the corpus's own
protocol, in-process: every clean control (bf16, 2 threads, autocast bf16; full and stats mode;
with and without the local replay) must pass, and a x1.05 defect on a middle Linear must fail
and be localized at that module. Clean cases that fail today are real false alarms, marked
xfail(strict=True) with the reason, so they show up as XPASS when the floor is fixed."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import zoo  # noqa: E402

SLICE = ("hf_falcon", "hf_mamba", "diffusers_dit")
MODES = ("full", "stats")

_ADAM_AUTOCAST = ("stats mode with --autocast bf16: Adam turns the rounding noise of near-zero "
                  "gradients into full-size steps on a few elements; the samples of the next "
                  "step's parameters miss that and the params entries fail (README, Known limits)")
_MAMBA_LOCAL = ("step 1, backbone.norm_f (MambaRMSNorm: fp32 input, the residual stream is kept in "
                "fp32; bf16 weight): its local replay differs from the reference by the bf16 "
                "rounding of the weight (rms 1e-3), but the local floor is the fp32 one of its "
                "input (6e-8): local ratio ~1.7e4")
KNOWN: dict[tuple[str, str, str, bool], str] = {
    **{(a, "autocast", "stats", loc): _ADAM_AUTOCAST for a in SLICE for loc in (True, False)},
    ("hf_mamba", "bf16", "full", True): _MAMBA_LOCAL,
    ("hf_mamba", "bf16", "stats", True): _MAMBA_LOCAL,
}

_results: dict[str, dict] = {}


def result(arch: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The corpus protocol for ``arch``, run once per test session."""
    if arch not in _results:
        _results[arch] = zoo.run_arch(arch, tmp_path_factory.mktemp(arch), MODES)
    r = _results[arch]
    assert r["status"] == "ok", r.get("error")
    return r


def _clean_cases():
    for arch in SLICE:
        for mode in MODES:
            for control in zoo.CONTROLS:
                for local in (True, False):
                    key = (arch, control, mode, local)
                    marks = [pytest.mark.xfail(strict=True, reason=KNOWN[key])] if key in KNOWN else []
                    yield pytest.param(*key, marks=marks,
                                       id=f"{arch}-{control}-{mode}-{'local' if local else 'nolocal'}")


@pytest.mark.parametrize("arch,control,mode,local", list(_clean_cases()))
def test_clean_control_passes(arch, control, mode, local, tmp_path_factory):
    r = result(arch, tmp_path_factory)
    case = next(c for c in r["controls"]
                if (c["control"], c["mode"], c["local"]) == (control, mode, local))
    assert case["verdict"] == "pass", (case.get("error") or case.get("decided_by"), case.get("worst", [])[:2])


@pytest.mark.parametrize("arch", SLICE)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("local", (True, False), ids=("local", "nolocal"))
def test_fault_is_localized(arch, mode, local, tmp_path_factory):
    r = result(arch, tmp_path_factory)
    case = next(f for f in r["faults"] if (f["mode"], f["local"]) == (mode, local))
    assert case["detected"], case
    assert case["localized"], (r["fault_module"], case.get("first_divergence"))


def test_zoo_entries_load_as_model_specs():
    """bench/zoo.py:NAME is a MODEL spec (driftcheck record bench/zoo.py:hf_falcon)."""
    from driftcheck.loader import load_scenario

    sc = load_scenario(f"{Path(zoo.__file__).resolve()}:hf_falcon")
    assert sc.steps == 2 and sum(p.numel() for p in sc.model.parameters()) > 1000
