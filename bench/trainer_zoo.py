"""The Trainer integration on the calibration corpus' transformers architectures (bench/zoo_hf.py:
model code this project did not write): does tracing through a real Hugging Face ``Trainer`` give
the verdicts ``driftcheck record`` gives on the same model?

    python bench/trainer_zoo.py                  # every hf architecture of the corpus
    python bench/trainer_zoo.py --limit 10 --only hf_bert,hf_gpt2

Per architecture (torch threads 1, the corpus' own batches of 2 examples, 2 optimizer steps):
- through the Trainer (driftcheck.integrations.transformers.DriftcheckCallback): an fp32
  reference; a clean target with ``bf16=True`` that replays it; an fp32 target with the
  corpus' defect (a middle Linear/Conv x1.05, bench/zoo.py:middle_module) that replays it;
- through ``record()``: the same fp32 reference and the clean target under autocast bf16.
A clean target passes when its verdict is "pass"; the defect is detected when the verdict fails
and localized when the first divergence names the module. "agree" says whether the Trainer's
clean verdict is record()'s. It prints one row per architecture and the rates.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import zoo  # noqa: F401  (sys.path, the corpus' catalogue)

import torch  # noqa: E402

from driftcheck.compare import compare  # noqa: E402
from driftcheck.targets.faults import scale_output  # noqa: E402
from driftcheck.record.runner import record  # noqa: E402

FACTOR = zoo.FACTOR


def _trainer(sc: Any, out: Path, work: Path, *, replay: Path | None = None, bf16: bool = False,
             fault: str | None = None) -> None:
    from transformers import Trainer, TrainingArguments

    from driftcheck.integrations.transformers import DriftcheckCallback

    if fault:
        scale_output(fault, FACTOR)(sc.model)
    data = [sc.batch(i) for i in range(sc.steps)]  # each item is a whole batch of the corpus
    args = TrainingArguments(output_dir=str(work / "trainer"), max_steps=sc.steps,
                             per_device_train_batch_size=1, learning_rate=1e-3, report_to=[],
                             use_cpu=True, bf16=bf16, save_strategy="no", disable_tqdm=True,
                             logging_strategy="no", remove_unused_columns=False)
    cb = DriftcheckCallback(out, steps=sc.steps, replay=replay, force=True)
    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its own metrics
        Trainer(model=sc.model, args=args, train_dataset=data, data_collator=lambda rows: rows[0],
                callbacks=[cb]).train()


def run_arch(name: str, work: Path) -> dict[str, Any]:
    build = zoo.CATALOGUE[name][1]
    res: dict[str, Any] = {"name": name}
    root = Path(tempfile.mkdtemp(prefix=f"tz-{name}-", dir=work))
    t0 = time.perf_counter()
    try:
        try:
            pristine = build()
            zoo.plain_steps(zoo.fresh(pristine, build))
        except Exception as e:
            res.update(status="could not build", error=zoo.one_line(e))
            return res
        try:
            _trainer(zoo.fresh(pristine, build), root / "ref", root)
            res["fault_module"] = zoo.middle_module(pristine.model, root / "ref")[0]
        except Exception as e:
            res.update(status="error", error=f"trainer reference: {zoo.one_line(e)}")
            return res
        res["status"] = "ok"
        # the defect on an fp32 target, as bench/zoo.py injects it (x1.05 is >= 4 floors there)
        for case, kw in (("clean", {"bf16": True}), ("fault", {"fault": res["fault_module"]})):
            try:
                _trainer(zoo.fresh(pristine, build), root / case, root, replay=root / "ref", **kw)
                rep = compare(root / "ref", root / case)
                fd = rep.first_divergence or {}
                res[case] = {"verdict": rep.verdict, "worst": max((e.ratio for e in rep.entries
                                                                   if e.ratio is not None), default=0.0),
                             "first": fd.get("module")}
            except Exception as e:
                res[case] = {"verdict": "error", "error": zoo.one_line(e)}
        try:
            record(zoo.fresh(pristine, build), root / "rref", force=True, model_id=name)
            record(zoo.fresh(pristine, build), root / "rtgt", replay=root / "rref", autocast="bf16",
                   force=True, model_id=name)
            res["record_clean"] = compare(root / "rref", root / "rtgt").verdict
        except Exception as e:
            msg = zoo.one_line(e)
            # the model's own code cannot run under autocast bf16 (DeBERTa): not a verdict
            res["record_clean"] = "n/a" if "(fix the model code" in msg else f"error: {msg}"
            if res["record_clean"] == "n/a":
                res["status"] = "n/a: the model code fails under autocast bf16"
    finally:
        res["secs"] = time.perf_counter() - t0
        shutil.rmtree(root, ignore_errors=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="NAME[,NAME]: these architectures")
    ap.add_argument("--limit", type=int, default=0, help="the first N")
    ap.add_argument("--json", help="write every result here")
    args = ap.parse_args()
    names = [n for n, (fam, _) in zoo.CATALOGUE.items() if fam == "hf"]
    if args.only:
        names = [n for n in args.only.split(",") if n in names]
    names = names[:args.limit] if args.limit else names
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    work = Path(tempfile.mkdtemp(prefix="trainer-zoo-"))
    results = []
    print(f"{'architecture':28s} {'clean':6s} {'worst':>7s} {'record':7s} {'agree':5s} {'fault':6s} localized")
    for n in names:
        r = run_arch(n, work)
        results.append(r)
        if r["status"] != "ok":
            print(f"{n:28s} {r['status']}: {r.get('error', '')[:90]}")
            continue
        c, f = r.get("clean", {}), r.get("fault", {})
        agree = c.get("verdict") == r.get("record_clean")
        loc = f.get("verdict") == "fail" and f.get("first") == r["fault_module"]
        print(f"{n:28s} {c.get('verdict', '?'):6s} {c.get('worst', float('nan')):7.3g} "
              f"{str(r.get('record_clean'))[:7]:7s} {str(agree):5s} {f.get('verdict', '?'):6s} "
              f"{loc} {c.get('error', '') or f.get('error', '')}"[:200], flush=True)
    shutil.rmtree(work, ignore_errors=True)
    ok = [r for r in results if r["status"] == "ok"]
    na = sum(r["status"].startswith("n/a") for r in results)
    clean_pass = sum(r.get("clean", {}).get("verdict") == "pass" for r in ok)
    agree = sum(r.get("clean", {}).get("verdict") == r.get("record_clean") for r in ok)
    det = sum(r.get("fault", {}).get("verdict") == "fail" for r in ok)
    loc = sum(r.get("fault", {}).get("verdict") == "fail" and r["fault"].get("first") == r["fault_module"]
              for r in ok)
    print(f"\n{len(ok)} architectures through the Trainer ({na} whose code cannot run autocast bf16, "
          f"{len(results) - len(ok) - na} not built or failed): "
          f"clean bf16 passes {clean_pass}/{len(ok)}, same verdict as record() {agree}/{len(ok)}, "
          f"defect detected {det}/{len(ok)}, localized {loc}/{len(ok)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
