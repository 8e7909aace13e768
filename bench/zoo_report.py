"""bench/zoo.py's parallel runner (worker processes, a hard timeout per architecture) and its
tables: false-alarm rate per control/mode/local replay, detection and localization, the worst
clean ratios, the findings of failing clean cases, what could not be built."""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

GRACE = 60  # seconds past --timeout before a worker is killed (its alarm did not fire)


def run_workers(names: list[str], args: argparse.Namespace, script: Path,
                families: dict[str, str]) -> list[dict[str, Any]]:
    """Each name in a worker process (``--jobs`` of them, reused), killed and replaced when it
    overruns ``--timeout`` + GRACE or dies; results in catalogue order."""
    results: dict[str, dict[str, Any]] = {}
    if args.resume:  # the results of an interrupted run: kept, not rerun
        resdir = Path(args.resume)
        resdir.mkdir(parents=True, exist_ok=True)
        for n in names:
            if (resdir / f"{n}.json").is_file():
                results[n] = json.loads((resdir / f"{n}.json").read_text())
    else:
        resdir = Path(tempfile.mkdtemp(prefix="zoo-results-", dir=args.work))
    print(f"[zoo] results in {resdir} ({len(results)} already there)", file=sys.stderr, flush=True)
    todo = collections.deque(n for n in names if n not in results)
    lock = threading.Lock()
    cmd = [sys.executable, str(script), "--worker", "--results", str(resdir), "--modes", args.modes,
           "--timeout", str(args.timeout)] + (["--work", args.work] if args.work else []) + (
           ["--compile", args.compile] if getattr(args, "compile", None) else []) + (
           ["--controls", args.controls] if getattr(args, "controls", None) else []) + \
        (["--local-only"] if getattr(args, "local_only", False) else []) + \
        (["--control-run"] if getattr(args, "control_run", False) else [])

    def spawn(i: int) -> subprocess.Popen:
        log = open(resdir / f"worker-{i}.log", "ab")
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=log, text=True)

    def loop(i: int) -> None:
        proc = spawn(i)
        while True:
            with lock:
                if not todo:
                    break
                name = todo.popleft()
            out = resdir / f"{name}.json"
            t0 = time.perf_counter()
            proc.stdin.write(name + "\n")
            proc.stdin.flush()
            while not out.exists():
                dead = proc.poll() is not None
                if dead or time.perf_counter() - t0 > args.timeout + GRACE:
                    proc.kill()
                    proc.wait()
                    why = (f"the worker died (exit {proc.returncode})" if dead
                           else f"killed after {args.timeout + GRACE} s")
                    results[name] = {"name": name, "family": families[name], "status": "timeout"
                                     if not dead else "error", "error": why,
                                     "secs": time.perf_counter() - t0, "controls": [], "faults": []}
                    proc = spawn(i)
                    break
                time.sleep(0.2)
            else:
                results[name] = json.loads(out.read_text())
            r = results[name]
            print(f"[zoo] {name}: {r['status']} {r.get('secs', 0):.1f} s "
                  f"{line(r)}", file=sys.stderr, flush=True)
        proc.stdin.close()
        proc.wait()

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(max(1, args.jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [results[n] for n in names if n in results]


def line(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return r.get("error", "")
    bad = [f"{c['control']}/{c['mode']}{'/local' if c['local'] else ''}" for c in r["controls"]
           if c["verdict"] != "pass"]
    miss = [f"{f['mode']}{'/local' if f['local'] else ''}" for f in r["faults"] if not f.get("localized")]
    return (f"clean fails: {', '.join(bad) or '-'}; fault not localized: {', '.join(miss) or '-'}")


def meta(args: argparse.Namespace, secs: float) -> dict[str, Any]:
    import driftcheck
    import torch

    where = Path(driftcheck.__file__).resolve().parent.parent
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(where), *a], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except Exception:
            return ""
    return {"driftcheck": str(Path(driftcheck.__file__).resolve()), "commit": git("rev-parse", "--short", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--", "driftcheck")), "torch": torch.__version__,
            "modes": args.modes, "jobs": args.jobs, "timeout": args.timeout, "wall_secs": secs,
            "cpus": os.cpu_count(), "compile": getattr(args, "compile", None),
            "controls": getattr(args, "controls", None),
            "control_run": getattr(args, "control_run", False),
            "python_hash_seed": os.environ.get("PYTHONHASHSEED"),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _ratio(r: Any) -> float:
    if r is None:
        return -1.0
    return math.inf if isinstance(r, float) and math.isnan(r) else float(r)


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The rates: every architecture that built counts in every denominator; one whose record
    raised or timed out counts as a failure of each of its cases."""
    ran = [r for r in results if r["status"] != "unbuildable"]
    broken = [r for r in ran if r["status"] != "ok"]
    ok = [r for r in ran if r["status"] == "ok"]
    cases = sorted({(c["control"], c["mode"], c["local"]) for r in ok for c in r["controls"]},
                   key=lambda k: (k[1], k[0], not k[2]))
    controls = []
    for control, mode, local in cases:
        every = [c for r in ok for c in r["controls"] if (c["control"], c["mode"], c["local"]) == (control, mode, local)]
        cs = [c for c in every if c["verdict"] != "n/a"]  # the model's code cannot run it
        fails = sum(c["verdict"] == "fail" for c in cs)
        errors = sum(c["verdict"] == "error" for c in cs) + len(broken)
        worst = max((_ratio(e["score"]) for c in cs for e in c.get("worst", [])[:1]), default=0.0)
        controls.append({"control": control, "mode": mode, "local": local, "cases": len(cs) + len(broken),
                         "fail": fails, "error": errors, "n/a": len(every) - len(cs),
                         "rate": (fails + errors) / max(1, len(cs) + len(broken)),
                         "worst": worst})
    faults = []
    for mode, local in sorted({(f["mode"], f["local"]) for r in ok for f in r["faults"]},
                              key=lambda k: (k[0], not k[1])):
        fs = [(r, f) for r in ok for f in r["faults"] if (f["mode"], f["local"]) == (mode, local)]
        n = len(fs) + len(broken)
        big = [(r, f) for r, f in fs if (f_size(r, f) or 0) >= 4]
        sizes = sorted(x for x in (f_size(r, f) for r, f in fs) if x is not None)
        faults.append({"mode": mode, "local": local, "cases": n,
                       "median_size": sizes[len(sizes) // 2] if sizes else None,
                       "min_size": sizes[0] if sizes else None,
                       "detected": sum(bool(f.get("detected")) for _, f in fs),
                       "localized": sum(bool(f.get("localized")) for _, f in fs),
                       "errors": sum(f["verdict"] == "error" for _, f in fs) + len(broken),
                       "ge4": len(big), "ge4_localized": sum(bool(f.get("localized")) for _, f in big)})
    return {"architectures": len(results), "ran": len(ran), "ok": len(ok), "broken": len(broken),
            "unbuildable": len(results) - len(ran), "controls": controls, "faults": faults}


def f_size(r: dict[str, Any], f: dict[str, Any]) -> float | None:
    """The fault's size in clean bf16 floors (measured on the full-mode records)."""
    sizes = [x.get("size_floors") for x in r["faults"] if x.get("size_floors") is not None]
    return f.get("size_floors") if f.get("size_floors") is not None else (sizes[0] if sizes else None)


def _section(title: str, header: str) -> list[str]:
    """A Markdown section opening with a table: a blank line, the title, the header and its rule."""
    return ["", f"## {title}", "", header, "|" + "---|" * (header.count("|") - 1)]


def _loc(local: bool) -> str:
    return "yes" if local else "no"


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    x = _ratio(x)
    return "inf" if math.isinf(x) else f"{x:.2f}"


def _fd(fd: dict[str, Any] | None) -> str:
    if not fd:
        return "-"
    return (f"`{fd.get('module') or '(model)'}` {fd.get('phase')} {fd.get('slot')} "
            f"({_fmt(fd.get('ratio'))}/{_fmt(fd.get('local_ratio'))})")


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    s = summary(results)
    ok = [r for r in results if r["status"] == "ok"]
    fams = collections.Counter(r["family"] for r in results if r["status"] != "unbuildable")
    out = [f"# driftcheck zoo: {s['ran']} architectures ran ({', '.join(f'{k} {v}' for k, v in sorted(fams.items()))}), "
           f"{s['unbuildable']} could not be built",
           f"driftcheck {meta.get('commit')}{' (dirty)' if meta.get('dirty') else ''} from {meta.get('driftcheck')}, "
           f"torch {meta.get('torch')} ({meta.get('cpu_capability') or '?'} CPU kernels), modes {meta.get('modes')}, "
           f"{'controls ' + meta['controls'] + ', ' if meta.get('controls') else ''}{meta.get('jobs')} job(s), "
           f"{'targets compiled with ' + meta['compile'] + ', ' if meta.get('compile') else ''}"
           f"{meta.get('wall_secs', 0) / 60:.1f} min wall", "",
           ] + _section("Clean controls (false alarms = failed or errored verdicts / architectures)",
                        "| control | mode | local replay | cases | fail | error | not a clean run (model or machine) | false-alarm rate | worst ratio |")[1:]
    for c in s["controls"]:
        out.append(f"| {c['control']} | {c['mode']} | {_loc(c['local'])} | {c['cases']} | {c['fail']} | "
                   f"{c['error']} | {c.get('n/a', 0)} | {100 * c['rate']:.1f}% | {_fmt(c['worst'])} |")
    out += _section("Injected defect (x1.05 on a middle Linear/Conv output, fp32 target)", "| mode | local replay | cases | detected | localized | errors | >= 4x floor: localized | size in bf16 floors (min / median) |")
    for f in s["faults"]:
        out.append(f"| {f['mode']} | {_loc(f['local'])} | {f['cases']} | {f['detected']} | {f['localized']} | "
                   f"{f['errors']} | {f['ge4_localized']}/{f['ge4']} | {_fmt(f['min_size'])} / {_fmt(f['median_size'])} |")
    worst = sorted(((r, c, e) for r in ok for c in r["controls"] for e in c.get("worst", [])[:1]),
                   key=lambda t: -_ratio(t[2]["score"]))[:15]
    out += _section("The 15 worst clean ratios", "| architecture | control | mode | local | ratio (local ratio) | module | phase | slot | module type | verdict |")
    for r, c, e in worst:
        out.append(f"| {r['name']} | {c['control']} | {c['mode']} | {_loc(c['local'])} | {_fmt(e['ratio'])} ({_fmt(e.get('local_ratio'))}) | "
                   f"`{e['module'] or '(model)'}` | {e['phase']} | {e['slot']} | {e.get('module_type') or '-'} | {c['verdict']} |")
    out += _section("Failing clean cases", "| architecture | control | mode | local | worst entry (ratio/local ratio, module type) | first divergence | error findings |")
    for r in ok:
        for c in r["controls"]:
            if c["verdict"] == "pass":
                continue
            if c["verdict"] in ("error", "n/a"):  # n/a: the model's own code cannot run it
                out.append(f"| {r['name']} | {c['control']} | {c['mode']} | {_loc(c['local'])} | {c['verdict']} | - | {c['error']} |")
                continue
            e = (c.get("worst") or [{}])[0]
            kinds = collections.Counter(f["kind"] for f in c.get("errors", []) if f.get("gate") != "ignored")
            out.append(f"| {r['name']} | {c['control']} | {c['mode']} | {_loc(c['local'])} | "
                       f"`{e.get('module') or '(model)'}` {e.get('phase')} {e.get('slot')} ({_fmt(e.get('ratio'))}/"
                       f"{_fmt(e.get('local_ratio'))}, "
                       f"{e.get('module_type') or '-'}) | {_fd(c.get('first_divergence'))} | "
                       f"{', '.join(f'{k} x{v}' for k, v in kinds.items()) or '-'} |")
    out += _section("Defects not localized", "| architecture | mode | local | injected | size (floors) | verdict | blamed module (phase slot) |")
    for r in ok:
        for f in r["faults"]:
            if f.get("localized"):
                continue
            fd = f.get("first_divergence") or {}
            out.append(f"| {r['name']} | {f['mode']} | {_loc(f['local'])} | `{r['fault_module']}` | "
                       f"{_fmt(f_size(r, f))} | {f['verdict']}{': ' + f['error'] if f.get('error') else ''} | "
                       f"`{fd.get('module')}` ({fd.get('phase')} {fd.get('slot')}) |")
    out += ["", "## Errors, timeouts and architectures that could not be built", ""]
    for r in results:
        if r["status"] != "ok":
            out.append(f"- {r['name']} ({r['family']}): {r['status']}: {r.get('error')}")
    out += _section("Time per architecture", "| architecture | family | params | modules | entries (full ref) | seconds |")
    for r in results:
        if r["status"] != "unbuildable":
            out.append(f"| {r['name']} | {r['family']} | {r.get('params', '-')} | {r.get('modules', '-')} | "
                       f"{r.get('entries', '-')} | {r.get('secs', 0):.1f} |")
    return "\n".join(out)
