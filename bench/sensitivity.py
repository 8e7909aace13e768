"""Sensitivity: how small a defect driftcheck finds, and names, wherever it sits.

A defect of a given relative size (0.1% to 5%) is injected into the target run only, at one of
six positions, on several architectures, in an fp32 and a bf16 target against an fp32 reference:

- ``leaf``: a leaf module's output times (1 + size) (targets.faults.scale_output);
- ``parent``: one op of a composite module's own code, between its children (a SwiGLU's
  product, a residual add) times (1 + size) (targets.opfaults.scale_op);
- ``backward``: a leaf module's input gradient times (1 + size) (targets.faults.scale_grad);
- ``update``: the optimizer's update of a leaf's parameters times (1 + size)
  (targets.stepfaults.scale_update);
- ``compiled``: the leaf's output fault inside a ``torch.compile`` graph (the target compiled
  with ``--compile-backend``, default aot_eager; no local replay there; the two largest sizes);
- ``stats``: the leaf's output fault with reference and target recorded in stats mode.

A case is *detected* when the verdict fails, *localized* when the first divergence blames the
injected module (for ``parent``, the composite). Controls: each architecture's clean target in
each dtype and capture (full, stats, compiled) must pass.

    python bench/sensitivity.py                 # 6 architectures (about 12 min on 2 cores)
    python bench/sensitivity.py --quick         # 3 architectures, sizes 0.1%, 1%, 2%, 5%
    python bench/sensitivity.py --models llama,vit --positions parent,leaf --json out.json
    python bench/sensitivity.py --control       # judged with a control run (issue 47): what it hides
"""
from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c  # noqa: E402

import torch  # noqa: E402

from driftcheck.compare import compare  # noqa: E402
from driftcheck.loader import load_scenario  # noqa: E402
from driftcheck.record.runner import record  # noqa: E402
from driftcheck.targets import faults, opfaults, stepfaults  # noqa: E402

# per architecture: a leaf (Linear/Conv) and a composite's own op (module, ATen op)
SITES: dict[str, dict[str, Any]] = {
    "llama": {"leaf": "layers.1.mlp.down_proj", "parent": ("layers.1.mlp", "mul")},
    "vit": {"leaf": "blocks.1.mlp.fc1", "parent": ("blocks.0", "add")},
    "resnet": {"leaf": "layer1.conv2", "parent": ("layer1", "add_")},
    "mlp": {"leaf": "fc2", "parent": None},  # its forward is its children only
    "hf:llama": {"leaf": "model.layers.1.mlp.down_proj", "parent": ("model.layers.1.mlp", "mul")},
    "hf:qwen2": {"leaf": "model.layers.0.self_attn.o_proj", "parent": ("model.layers.0.mlp", "mul")},
}
POSITIONS = ("leaf", "parent", "backward", "update", "compiled", "stats")
SIZES = (0.001, 0.005, 0.01, 0.02, 0.05)


def fault_of(position: str, site: dict[str, Any], size: float) -> tuple[Any, str] | None:
    """(the fault, the module it should be blamed on), or None where the site has none."""
    f = 1.0 + size
    if position == "parent":
        if site["parent"] is None:
            return None
        module, op = site["parent"]
        return opfaults.scale_op(module, op, f), module
    if position == "backward":
        return faults.scale_grad(site["leaf"], f), site["leaf"]
    if position == "update":
        return stepfaults.scale_update(site["leaf"], f), site["leaf"]
    return faults.scale_output(site["leaf"], f), site["leaf"]


def capture_of(position: str) -> str:
    """How the target is recorded: ``compiled``, ``stats`` or full (named ``leaf``)."""
    return position if position in ("compiled", "stats") else "leaf"


def control_of(root: Path, model: str, ref: Path, dtype: str, stats: bool) -> Path:
    """The control run of ``ref`` (recorded once): the reference device at ``dtype``, with
    another intra-op thread count than the target's, as ``driftcheck run`` records it."""
    ctl = ref.parent / f"control-{dtype}{'-stats' if stats else ''}"
    if not (ctl / "manifest.json").exists():
        old = torch.get_num_threads()
        torch.set_num_threads(1 if old > 1 else 2)
        try:
            record(load_scenario(model), ctl, dtype=dtype, replay=ref, force=True, model_id=model,
                   **({"mode": "stats"} if stats else {"local": ref}))
        finally:
            torch.set_num_threads(old)
    return ctl


def run_case(root: Path, model: str, position: str, dtype: str, fault: Any, backend: str,
             control: bool = False) -> Any:
    """Record one target (``fault`` may be None: a control) and compare it with its reference
    (and with ``control``, the control run: an entry fails where both object)."""
    stats = position == "stats"
    ref = root / model.replace(":", "_") / ("ref-stats" if stats else "ref")
    if not (ref / "manifest.json").exists():
        record(load_scenario(model), ref, force=True, model_id=model, mode="stats" if stats else "full")
    ctl = control_of(root, model, ref, dtype, stats) if control else None
    out = root / "target"
    # full mode replays locally, as `driftcheck run` does by default
    kw: dict[str, Any] = {"mode": "stats"} if stats else {"local": ref}
    if position == "compiled":
        kw["compile"] = {"backend": backend, "mode": None, "dynamic": None}
    try:
        record(load_scenario(model), out, dtype=dtype, replay=ref, force=True, model_id=model,
               target_hooks=fault, **kw)
    finally:
        if fault is not None:
            fault.remove()
    return compare(str(ref), str(out), control=str(ctl) if ctl is not None else None)


def main() -> int:
    args = c.parse_args(__doc__, models=dict(default=None, help="comma-separated architectures"),
                        positions=dict(default=",".join(POSITIONS)),
                        sizes=dict(default=None, help="comma-separated relative sizes"),
                        dtypes=dict(default="fp32,bf16"),
                        compile_backend=dict(default="aot_eager"),
                        json=dict(default=None, help="write every case here"),
                        control=dict(action="store_true",
                                     help="judge with a control run (the reference device at the "
                                          "target's dtype, another thread count), as driftcheck run does "
                                          "when a verdict would fail"))
    models = args.models.split(",") if args.models else \
        (["llama", "vit", "hf:llama"] if args.quick else list(SITES))
    sizes = [float(s) for s in args.sizes.split(",")] if args.sizes else \
        ([0.001, 0.01, 0.02, 0.05] if args.quick else list(SIZES))
    positions = args.positions.split(",")
    cases: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="driftcheck-sensitivity-") as tmp:
        root = Path(tmp)
        for model in models:
            site = SITES[model]
            for dtype in args.dtypes.split(","):
                for position in positions:
                    # one clean control per capture (full, compiled, stats)
                    control = [None] if capture_of(position) == position or \
                        capture_of(position) not in positions else []
                    # a compiled target compiles anew each time: its two largest sizes only
                    for size in control + (sizes[-2:] if position == "compiled" else sizes):
                        made = fault_of(position, site, size) if size is not None else None
                        if size is not None and made is None:
                            continue
                        fault, blame = made if made is not None else (None, None)
                        t0 = time.perf_counter()
                        rep = run_case(root, model, position, dtype, fault, args.compile_backend,
                                       args.control)
                        fd = rep.first_divergence or {}
                        case = {"model": model, "dtype": dtype, "position": position, "size": size,
                                "expected": blame, "verdict": rep.verdict,
                                "blamed": fd.get("blame_module"), "phase": fd.get("phase"),
                                "ratio": fd.get("ratio"), "local_ratio": fd.get("local_ratio"),
                                "worst": max((e.ratio for e in rep.entries if e.ratio is not None
                                              and math.isfinite(e.ratio)), default=0.0),
                                "worst_local": max((e.local_ratio for e in rep.entries
                                                    if e.local_ratio is not None
                                                    and math.isfinite(e.local_ratio)), default=0.0),
                                "seconds": round(time.perf_counter() - t0, 2)}
                        case["detected"] = rep.verdict == "fail"
                        case["localized"] = case["detected"] and fd.get("blame_module") == blame
                        cases.append(case)
                        print(json.dumps(case), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(cases, indent=1))
    print_tables(cases, positions, sizes, args.dtypes.split(","), models, time.perf_counter() - t_all)
    return 0


def print_tables(cases: list[dict[str, Any]], positions: list[str], sizes: list[float],
                 dtypes: list[str], models: list[str], seconds: float) -> None:
    rows = []
    for dtype in dtypes:
        for position in positions:
            row: list[Any] = [dtype, position]
            smallest = None
            for size in sizes:
                sel = [x for x in cases if x["dtype"] == dtype and x["position"] == position
                       and x["size"] == size]
                if not sel:
                    row.append("-")
                    continue
                det = sum(x["detected"] for x in sel)
                loc = sum(x["localized"] for x in sel)
                row.append(f"{det}/{len(sel)} · {loc}/{len(sel)}")
                if smallest is None and loc >= 0.95 * len(sel):
                    smallest = size
            ctl = [x for x in cases if x["dtype"] == dtype and x["size"] is None
                   and capture_of(x["position"]) == capture_of(position)]
            row.append("-" if smallest is None else f"{smallest * 100:g}%")
            row.append(f"{sum(x['detected'] for x in ctl)}/{len(ctl)}")
            row.append(f"{max((x['worst'] for x in ctl), default=0.0):.2f}")
            row.append(f"{max((x['worst_local'] for x in ctl), default=0.0):.2f}")
            rows.append(row)
    c.print_table(["dtype", "position"] + [f"{s * 100:g}%: detected · localized" for s in sizes]
                  + ["smallest localized in >= 95%", "controls failed", "worst control ratio",
                     "worst control local ratio"], rows)
    print(f"\n{len(cases)} cases on {', '.join(models)}; {seconds:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
