"""The calibration corpus: 100+ architectures of third-party model code (torchvision, timm,
transformers, diffusers) that driftcheck's own code and tests did not shape, each run through
the same protocol: clean controls must pass, an injected defect must fail at its module.

    bash bench/zoo_env.sh                          # torchvision + timm into bench/.zoo-site
    python bench/zoo.py --jobs 2 --json zoo.json   # the whole corpus (~30-40 min on 2 cores)
    python bench/zoo.py --families hf,diffusers --limit 5
    python bench/zoo.py --only "$(python -c 'import sys; sys.path.insert(0, "bench"); import zoo_more; print(",".join(zoo_more.MORE))')"
    python bench/zoo.py --only timm_vit,hf_roberta --modes full
    python bench/zoo.py --only tv_resnet,hf_led --modes full --controls isa_default,isa_avx2,mkldnn_off
    python bench/zoo.py --compile inductor --modes full --limit 12   # compiled targets
    driftcheck record bench/zoo.py:timm_vit --out ref   # any entry is a MODEL spec

Per architecture (in-process, through record() and compare(), ~2 steps of AdamW on batch 2):
an fp32 reference (torch intra-op threads 1) in full mode (with the view audit) and in stats
mode (replayed from the full one, so both share one replay id and the full one can serve as
the local replay of stats targets); against it three clean controls, each recorded in full
mode (view audit on) and in stats mode, with and without the local replay (--local):
  bf16      the target in bf16 (dtype="bf16")
  threads   the target in fp32 with 2 intra-op threads
  autocast  the target in fp32 under torch.autocast bf16
and three real-kernel controls, fp32 targets computed by other real CPU kernels (docs/noise-floor.md):
  isa_default  ATEN_CPU_CAPABILITY=default: ATen's non-vectorised kernels
  isa_avx2     ATEN_CPU_CAPABILITY=avx2 (where the reference ran AVX512 kernels)
  mkldnn_off   oneDNN off (record(mkldnn=False), --mkldnn off): ATen's own convolutions
The variable is read when torch loads, so the isa_* targets are recorded in a fresh process
(`python -m driftcheck record bench/zoo.py:NAME --replay REF --env ATEN_CPU_CAPABILITY=...`,
one intra-op thread as the reference); the others in-process.
and one defect: the output of a middle Linear/Conv x1.05 on an fp32 target (same variants).
A clean control passes when the verdict is "pass" (a bf16 or autocast target whose grouped conv1d
this machine's bf16 kernel gets wrong, bench/kernel_check.py, is no clean run: failed at that
conv, it is listed with the controls the model cannot run); the defect is detected when the verdict
fails and localized when report.first_divergence["module"] is the injected module. The
defect's size is measured in floors of the clean bf16 run at that module (step 0, full mode):
rms(faulty - reference) / floor, as bench/faults.py does. An architecture that cannot be built
or trained in plain PyTorch is listed as "could not build"; a record or compare that raises
counts as a failure of that case, with its one-line error.

With --control-run a case that fails is judged again with a control run, as `driftcheck run`
does (docs/diagnosis.md, "The control run"): the reference device at the target's precision
(its dtype or autocast) with another intra-op thread count, recorded once per mode, precision
and replay; an entry fails only where the analytic floor and the control both object. The
processes take the caller's PYTHONHASHSEED (recorded in the results' meta): run the corpus
with several (PYTHONHASHSEED=1 python bench/zoo.py ...) for models whose call order follows a
set's.

With --compile BACKEND every target (controls and defect) is recorded through torch.compile with
that backend against the same eager fp32 reference, as `driftcheck record --compile` does: no
local replay and no view audit there (a compiled record takes neither), so each control and the
defect run once per mode.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
try:  # driftcheck from PYTHONPATH or the venv (a snapshot run sets PYTHONPATH=<worktree>)
    import driftcheck  # noqa: F401
except ImportError:
    sys.path.append(str(BENCH.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import zoo_models  # noqa: E402  (puts bench/.zoo-site on sys.path first)
from kernel_check import wrong_bf16_conv2ds, wrong_bf16_convs  # noqa: E402
from driftcheck.compare import compare  # noqa: E402
from driftcheck.targets.faults import scale_output  # noqa: E402
from driftcheck.record.runner import record  # noqa: E402
from driftcheck.scenario import Scenario, call_model  # noqa: E402
from driftcheck.store import TraceReader  # noqa: E402


def _catalogue() -> dict[str, tuple[str, Callable[[], Scenario]]]:
    import zoo_hf
    import zoo_hf_media
    import zoo_more
    import zoo_timm

    cat: dict[str, tuple[str, Callable[[], Scenario]]] = {}
    for family, table in (("torchvision", zoo_models.TORCHVISION), ("timm", zoo_timm.TIMM),
                          ("hf", {**zoo_hf.HF_TEXT, **zoo_hf_media.HF_MEDIA}),
                          ("diffusers", zoo_hf_media.DIFFUSERS)):
        cat.update({name: (family, build) for name, build in table.items()})
    prefixes = {"tv_": "torchvision", "timm_": "timm", "hf_": "hf"}  # the second round (issue 47)
    cat.update({name: (next(f for p, f in prefixes.items() if name.startswith(p)), build)
                for name, build in zoo_more.MORE.items()})
    return cat


CATALOGUE = _catalogue()
globals().update({name: build for name, (_, build) in CATALOGUE.items()})  # bench/zoo.py:NAME

CONTROLS: dict[str, dict[str, Any]] = {"bf16": {"dtype": "bf16"}, "threads": {"threads": 2},
                                       "autocast": {"autocast": "bf16"},
                                       "isa_default": {"env": {"ATEN_CPU_CAPABILITY": "default"}},
                                       "isa_avx2": {"env": {"ATEN_CPU_CAPABILITY": "avx2"}},
                                       "mkldnn_off": {"mkldnn": False}}
FACTOR = 1.05


def one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"


def fresh(pristine: Scenario, build: Callable[[], Scenario]) -> Scenario:
    """A copy of the pristine scenario (each record trains and so changes its model)."""
    try:
        return copy.deepcopy(pristine)
    except Exception:
        return build()


def plain_steps(sc: Scenario) -> None:
    """The scenario's steps in plain PyTorch (no driftcheck): a model that fails here could not
    be built, it is not a driftcheck failure."""
    model, opt = sc.model, sc.optimizer(sc.model.parameters())
    model.train()
    for i in range(sc.steps):
        batch = sc.batch(i)
        loss = sc.loss(call_model(model, batch), batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"the loss of step {i} is {loss.item()}")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def middle_module(model: nn.Module, ref: Path) -> tuple[str, str]:
    """A Linear or convolution in the middle of the model that runs as a module, on an output
    that is not all zero (DAB-DETR's first decoder layer gets a zero key content: a factor on
    it injects nothing)."""
    ran = {e["module"] for e in TraceReader(ref).entries if e["phase"] == "forward"
           and str(e["slot"]).startswith("output") and (e.get("stats") or {}).get("l2", 1.0) != 0}
    names = [(n, type(m).__name__) for n, m in model.named_modules()
             if (isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)) or type(m).__name__ == "Conv1D")
             and n in ran]
    if not names:
        raise LookupError("no Linear/Conv module runs in the forward: nowhere to inject")
    return names[len(names) // 2]


def _finite(r: float | None) -> float:
    if r is None:
        return -1.0
    return math.inf if math.isnan(r) else r


def _score(e: Any) -> float:
    """An entry's judged ratio: the larger of its propagated and its local-replay ratio."""
    return max(_finite(e.ratio), _finite(e.local_ratio))


def _entry(e: Any) -> dict[str, Any]:
    return {"score": _score(e), "key": e.key, "module": e.module, "phase": e.phase, "step": e.step, "call": e.call,
            "slot": e.slot, "ratio": e.ratio, "local_ratio": e.local_ratio, "status": e.status,
            "limit": e.limit, "decided_by": e.decided_by,
            "module_type": e.details.get("module_type")}


def summarize_report(rep: Any, n_worst: int = 5) -> dict[str, Any]:
    judged = [e for e in rep.entries if e.ratio is not None and e.status != "ignored"]
    judged.sort(key=lambda e: -_score(e))
    fd = rep.first_divergence or {}
    return {"verdict": rep.verdict, "decided_by": rep.decided_by,
            "worst": [_entry(e) for e in judged[:n_worst]],
            "errors": [{"kind": f.kind, "module": f.module, "step": f.step, "phase": f.phase,
                        "gate": f.gate, "message": f.message[:200]}
                       for f in rep.findings if f.severity == "error"],
            "first_divergence": {k: fd.get(k) for k in ("module", "blame_module", "phase", "step",
                                                         "call", "slot", "ratio", "local_ratio",
                                                         "finding")} if fd else None}


class _Threads:
    def __init__(self, n: int) -> None:
        self.n, self.old = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *a: object) -> None:
        torch.set_num_threads(self.old)


def run_arch(name: str, work: str | os.PathLike | None = None, modes: tuple[str, ...] = ("full", "stats"),
             controls: tuple[str, ...] = tuple(CONTROLS), locals_: tuple[bool, ...] = (True, False),
             compile: str | None = None, control_run: bool = False) -> dict[str, Any]:
    """The whole protocol for one architecture; never raises for the model's or driftcheck's
    errors (they are in the result). ``compile``: the targets' torch.compile backend.
    ``control_run``: a case that fails is judged again with a control run, as ``driftcheck
    run`` does (the reference device at the target's precision, another thread count)."""
    family, build = CATALOGUE[name]
    res: dict[str, Any] = {"name": name, "family": family, "status": "ok", "controls": [], "faults": []}
    if compile:
        res["compile"], locals_ = compile, (False,)
    t_all = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix=f"zoo-{name}-", dir=work))
    try:
        with _Threads(1):
            t0 = time.perf_counter()
            try:
                pristine = build()
                plain_steps(fresh(pristine, build))
            except Exception as e:
                _check_timeout()
                res.update(status="unbuildable", error=one_line(e))
                return res
            res["build_secs"] = time.perf_counter() - t0
            res["params"] = sum(p.numel() for p in pristine.model.parameters())
            res["modules"] = sum(1 for _ in pristine.model.modules())
            ref, ref_stats = root / "ref", root / "ref-stats"
            try:
                t0 = time.perf_counter()
                record(fresh(pristine, build), ref, mode="full", view_audit=True, force=True, model_id=name)
                res["ref_secs"] = time.perf_counter() - t0
                res["entries"] = len(TraceReader(ref).entries)
                if "stats" in modes:
                    record(fresh(pristine, build), ref_stats, mode="stats", replay=ref, force=True,
                           model_id=name)
                res["fault_module"], res["fault_module_type"] = middle_module(pristine.model, ref)
            except Exception as e:
                _check_timeout()
                res.update(status="error", error=f"reference: {one_line(e)}")
                return res
        refs = {"full": ref, "stats": ref_stats}
        # this machine's bf16 kernels, checked once
        wrong = tuple(wrong_bf16_convs(pristine.model)) + tuple(wrong_bf16_conv2ds(pristine.model))
        floors: dict[str, float] = {}
        ctl_runs: dict[tuple, Path] | None = {} if control_run else None
        for mode in modes:
            for control in controls:
                for local in locals_:
                    res["controls"].append(_case(pristine, build, name, refs, root, mode, local,
                                                 control=control, floors=floors, wrong_convs=wrong,
                                                 compile=compile, control_runs=ctl_runs))
            for local in locals_:
                res["faults"].append(_case(pristine, build, name, refs, root, mode, local,
                                           fault=res["fault_module"], floors=floors, compile=compile,
                                           control_runs=ctl_runs))
    finally:
        res["secs"] = time.perf_counter() - t_all
        shutil.rmtree(root, ignore_errors=True)
    return res


def _case(pristine: Scenario, build: Callable[[], Scenario], name: str, refs: dict[str, Path],
          root: Path, mode: str, local: bool, control: str | None = None, fault: str | None = None,
          floors: dict[str, float] | None = None, wrong_convs: tuple[str, ...] = (),
          compile: str | None = None, control_runs: dict[tuple, Path] | None = None) -> dict[str, Any]:
    opts = dict(CONTROLS[control]) if control else {}
    threads = opts.pop("threads", 1)
    env = opts.pop("env", None)
    if compile:
        opts["compile"] = {"backend": compile, "mode": None, "dynamic": None}
    out = root / "target"
    case: dict[str, Any] = {"control": control, "mode": mode, "local": local}
    t0 = time.perf_counter()
    try:
        if env:
            record_elsewhere(name, out, env, mode=mode, replay=refs["full"], local=local,
                             view_audit=mode == "full" and not compile, compile=compile)
        else:
            with _Threads(threads):
                record(fresh(pristine, build), out, mode=mode, replay=refs["full"], force=True,
                       model_id=name, local=refs["full"] if local else None,
                       view_audit=mode == "full" and not compile,
                       target_hooks=scale_output(fault, FACTOR) if fault else None, **opts)
        rep = compare(refs[mode], out)
        if control_runs is not None and rep.verdict == "fail":
            case["alone"] = summarize_report(rep)  # the analytic floor's word, without the control
            ctl = control_of(pristine, build, name, refs, root, mode, local, opts, threads, control_runs)
            rep = compare(refs[mode], out, control=ctl)
            case["control_run"] = True
        case.update(summarize_report(rep))
        fd = rep.first_divergence or {}
        if control in ("bf16", "autocast") and rep.verdict == "fail" and fd.get("module") in wrong_convs:
            # not a clean target on this machine: its bf16 kernel is wrong, and driftcheck said
            # where (a true positive; bench/kernel_check.py)
            case.update(verdict="n/a", error=f"this machine's bf16 kernel of {fd['module']} is wrong "
                                              "(bench/kernel_check.py); driftcheck named it")
    except Exception as e:
        _check_timeout()
        msg = one_line(e)
        # The model's own code cannot run this control (RAFT in bf16, DeBERTa under autocast):
        # driftcheck says so in one line; not a verdict on driftcheck's floor.
        case.update(verdict="n/a" if "(fix the model code" in msg else "error", error=msg)
        rep = None
    case["secs"] = time.perf_counter() - t0
    key = (0, "forward", fault or "", 0, "output")
    if rep is not None and control == "bf16" and mode == "full" and floors is not None:
        for e in rep.entries:
            if e.phase == "forward" and e.step == 0 and e.call == 0 and e.slot == "output" and e.floor:
                floors.setdefault(e.module, e.floor)
    if rep is not None and fault:
        fd = rep.first_divergence or {}
        case["detected"] = rep.verdict == "fail"
        case["localized"] = case["detected"] and fault in (fd.get("module"), fd.get("blame_module"))
        at = next((e for e in rep.entries if (e.step, e.phase, e.module, e.call, e.slot) == key), None)
        case["fault_ratio"] = at.ratio if at is not None else None
        if mode == "full" and floors and floors.get(fault):
            case["size_floors"] = _size(refs["full"], out, key) / floors[fault]
    return case


def control_of(pristine: Scenario, build: Callable[[], Scenario], name: str, refs: dict[str, Path],
               root: Path, mode: str, local: bool, opts: dict[str, Any], threads: int,
               made: dict[tuple, Path]) -> Path:
    """The control run of a case (recorded once per mode, precision and replay): the reference
    device at the target's precision (its dtype or autocast), with another intra-op thread
    count than the reference's and the target's, as ``driftcheck run`` records it."""
    precision = {k: v for k, v in opts.items() if k in ("dtype", "autocast")}
    n = next(i for i in range(1, 4) if i not in (1, threads))
    key = (mode, local, tuple(sorted(precision.items())), n)
    if key not in made:
        out = root / f"control-{len(made)}"
        with _Threads(n):
            record(fresh(pristine, build), out, mode=mode, replay=refs["full"], force=True, model_id=name,
                   local=refs["full"] if local else None, view_audit=mode == "full", **precision)
        made[key] = out
    return made[key]


def record_elsewhere(name: str, out: Path, env: dict[str, str], *, mode: str, replay: Path,
                     local: bool, view_audit: bool, compile: str | None = None) -> None:
    """A target recorded in a fresh process under ``env``, set before torch loads there
    (ATEN_CPU_CAPABILITY is read once, at import), through the CLI as a user would; one intra-op
    thread, as the reference."""
    import driftcheck

    cmd = [sys.executable, "-m", "driftcheck", "--quiet", "record", f"{Path(__file__).resolve()}:{name}",
           "--out", str(out), "--replay", str(replay), "--mode", mode, "--force"]
    cmd += ["--local", str(replay)] if local else ["--no-local"]
    cmd += (["--view-audit"] if view_audit else []) + (["--compile", compile] if compile else [])
    cmd += [a for k, v in env.items() for a in ("--env", f"{k}={v}")]
    where = str(Path(driftcheck.__file__).resolve().parent.parent)
    path = os.pathsep.join(filter(None, (where, os.environ.get("PYTHONPATH"))))
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, **env),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        raise RuntimeError(f"record under {env} exited {proc.returncode}: "
                           f"{lines[-1] if lines else 'no message'}")


def _size(ref: Path, tgt: Path, key: tuple) -> float:
    """rms(target - reference) at ``key``: the injected perturbation (identical upstream)."""
    def find(reader: TraceReader) -> Any:
        return next(e for e in reader.entries
                    if (e["step"], e["phase"], e["module"], e["call"], e["slot"]) == key)
    r, t = TraceReader(ref), TraceReader(tgt)
    d = t.tensor(find(t)).double() - r.tensor(find(r)).double()
    return float(d.pow(2).mean().sqrt())


# -- the command line ------------------------------------------------------------------------
class ArchTimeout(BaseException):
    """--timeout ran out (a BaseException: no ``except Exception`` of the model, of driftcheck
    or of this protocol swallows it)."""


_TIMED_OUT = [False]  # set by the alarm: code that wraps every exception cannot hide it


def _alarm(signum: int, frame: Any) -> None:
    _TIMED_OUT[0] = True
    raise ArchTimeout("the architecture ran past --timeout")


def _check_timeout() -> None:
    if _TIMED_OUT[0]:
        raise ArchTimeout("the architecture ran past --timeout")


def worker(args: argparse.Namespace) -> int:
    """A child process: architecture names on stdin, one JSON file per result in --results."""
    warnings.filterwarnings("ignore")
    signal.signal(signal.SIGALRM, _alarm)
    modes = tuple(args.modes.split(","))
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        _TIMED_OUT[0] = False
        signal.alarm(args.timeout)
        try:
            res = run_arch(name, args.work, modes, compile=args.compile,
                           controls=tuple(args.controls.split(",")) if args.controls else tuple(CONTROLS),
                           locals_=(True,) if args.local_only else (True, False),
                           control_run=args.control_run)
        except ArchTimeout as e:
            res = {"name": name, "family": CATALOGUE[name][0], "status": "timeout", "error": str(e),
                   "secs": float(args.timeout), "controls": [], "faults": []}
        finally:
            signal.alarm(0)
        tmp = Path(args.results) / f".{name}.json"
        tmp.write_text(json.dumps(res, default=str))
        tmp.rename(Path(args.results) / f"{name}.json")
    return 0


def select(args: argparse.Namespace) -> list[str]:
    fams = set(args.families.split(",")) if args.families else None
    names = [n for n, (f, _) in CATALOGUE.items() if fams is None or f in fams]
    if args.only:
        wanted = args.only.split(",")
        unknown = [n for n in wanted if n not in CATALOGUE]
        if unknown:
            raise SystemExit(f"unknown architecture(s): {', '.join(unknown)} (--list shows them)")
        names = [n for n in wanted if n in names]
    return names[:args.limit] if args.limit else names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="NAME[,NAME]: these architectures")
    ap.add_argument("--families", help="torchvision,timm,hf,diffusers (default: all)")
    ap.add_argument("--limit", type=int, default=0, help="the first N selected")
    ap.add_argument("--jobs", type=int, default=1, help="parallel worker processes")
    ap.add_argument("--modes", default="full,stats", help="record modes (full,stats)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per architecture")
    ap.add_argument("--controls", help=f"CONTROL[,CONTROL]: these clean controls only (default: all of "
                    f"{','.join(CONTROLS)})")
    ap.add_argument("--compile", metavar="BACKEND", help="record every target through torch.compile "
                    "with this backend (inductor, aot_eager, ...)")
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--md", help="write the Markdown tables here too")
    ap.add_argument("--work", default=None, help="scratch folder for the traces")
    ap.add_argument("--resume", metavar="DIR", help="per-architecture results folder: results "
                    "already in it are kept (an interrupted run goes on), new ones written there")
    ap.add_argument("--local-only", action="store_true",
                    help="record the targets with the local replay only (not also without it)")
    ap.add_argument("--control-run", action="store_true",
                    help="judge a failing case again with a control run (the reference device at the "
                         "target's precision, another thread count), as driftcheck run does")
    ap.add_argument("--list", action="store_true", help="print the catalogue and exit")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    names = select(args)
    unknown = [c for c in (args.controls or "").split(",") if c and c not in CONTROLS]
    if unknown:
        raise SystemExit(f"unknown control(s): {', '.join(unknown)} (choose from {', '.join(CONTROLS)})")
    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)  # the workers make their folders in it
    if args.list:
        for n in names:
            print(f"{CATALOGUE[n][0]:12s} {n}")
        return 0
    import zoo_report

    t0 = time.perf_counter()
    results = zoo_report.run_workers(names, args, Path(__file__).resolve(),
                                     {n: f for n, (f, _) in CATALOGUE.items()})
    meta = zoo_report.meta(args, time.perf_counter() - t0)
    text = zoo_report.markdown(results, meta)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": zoo_report.summary(results),
                                               "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
