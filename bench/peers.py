"""driftcheck beside its nearest peer, msProbe (mindstudio-probe), on the same workloads in one run.

    python bench/peers.py [--quick] [--sizes tiny,16m] [--threads 2] [--steps 3]
    bash bench/peers_env.sh     # msProbe into bench/.peers-site (a bench-only dependency)

Workload: Hugging Face Llama built from a config (16m: hidden 512, 4 layers, 8 heads, 4 KV
heads, vocab 4096, ids (4, 256); tiny: hidden 32, 2 layers, 4 heads, 2 KV heads, vocab 512, ids
(2, 32)), AdamW, causal-LM loss. Each tool and mode runs in its own process (msProbe's debugger
is a process-wide singleton): one warm-up step, then the untraced step timed right before the
traced one, both as the median of --steps steps. Ratios are traced / untraced of that process.
"with finish" adds what the run costs after its last step (driftcheck: closing the trace,
every shard fsynced and the manifest written; msProbe: an os.sync() of what it wrote).
Tensors per step and MB per step are counted from what each tool wrote.
Without msProbe installed its rows say so in one line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS_SITE = HERE / ".peers-site"
SIZES = {
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, batch=(2, 32)),
    "16m": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=4096, batch=(4, 256)),
}
RUNS = [("msprobe", "statistics L0"), ("msprobe", "statistics mix"), ("msprobe", "tensor L0"),
        ("driftcheck", "stats"), ("driftcheck", "full")]
_MSPROBE_TASK = {"statistics L0": ("statistics", "L0"), "statistics mix": ("statistics", "mix"),
                 "tensor L0": ("tensor", "L0")}


def _build(size: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = dict(SIZES[size])
    b, n = spec.pop("batch")
    cfg = LlamaConfig(**spec, max_position_embeddings=max(n, 64), attn_implementation="eager",
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, spec["vocab_size"], (b, n), generator=torch.Generator().manual_seed(1))
    return model, opt, ids


def _step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _untraced(model, opt, ids, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _step(model, opt, ids)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _count_msprobe_tensors(path: Path) -> int:
    n = 0

    def walk(x):
        nonlocal n
        if isinstance(x, dict):
            if x.get("type") == "torch.Tensor":
                n += 1
                return
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    for f in path.rglob("dump.json"):
        walk(json.loads(f.read_text()).get("data", {}))
    return n


def _worker(size: str, tool: str, mode: str, steps: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    model, opt, ids = _build(size)
    _step(model, opt, ids)  # warm-up
    base = _untraced(model, opt, ids, steps)
    out = Path(tempfile.mkdtemp(prefix="dc-peers-", dir=os.environ.get("PEERS_DIR")))
    times = []
    try:
        if tool == "driftcheck":
            import driftcheck

            trace_dir = out / "trace"
            with driftcheck.trace(model, str(trace_dir), mode=mode, optimizer=opt) as t:
                for _ in range(steps):
                    t0 = time.perf_counter()
                    loss = _step(model, opt, ids)
                    t.step(loss)
                    times.append(time.perf_counter() - t0)
                f0 = time.perf_counter()
            finish = time.perf_counter() - f0  # the trace closed as the block ended
            entries = json.loads((trace_dir / "manifest.json").read_bytes())["entries"]
            tensors = len(entries) / steps
        else:
            sys.path.append(str(PEERS_SITE))
            from msprobe.pytorch import PrecisionDebugger

            task, level = _MSPROBE_TASK[mode]
            cfg = {"task": task, "dump_path": str(out / "dump"), "rank": [], "step": [],
                   "level": level, "async_dump": False,
                   task: {"scope": [], "list": [], "data_mode": ["all"]}}
            if task == "statistics":
                cfg[task]["summary_mode"] = "statistics"
            (out / "config.json").write_text(json.dumps(cfg))
            debugger = PrecisionDebugger(config_path=str(out / "config.json"))
            for _ in range(steps):
                t0 = time.perf_counter()
                debugger.start(model)
                _step(model, opt, ids)
                debugger.stop()
                debugger.step()
                times.append(time.perf_counter() - t0)
            f0 = time.perf_counter()
            os.sync()
            finish = time.perf_counter() - f0
            tensors = _count_msprobe_tensors(out / "dump") / steps
        traced = statistics.median(times)
        return {"size": size, "tool": tool, "mode": mode, "untraced_s": base, "traced_s": traced,
                "ratio": traced / base, "ratio_finish": (traced + finish / steps) / base,
                "finish_s": finish, "tensors_per_step": tensors,
                "mb_per_step": _dir_bytes(out) / steps / 1e6}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _msprobe_missing() -> str | None:
    probe = [sys.executable, "-c", f"import sys; sys.path.append({str(PEERS_SITE)!r}); "
             "import msprobe.pytorch"]
    r = subprocess.run(probe, capture_output=True, text=True)
    if r.returncode == 0:
        return None
    last = (r.stderr.strip().splitlines() or ["not importable"])[-1]
    return f"msProbe not installed ({last}); run `bash bench/peers_env.sh`"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny only, 3 steps")
    ap.add_argument("--sizes", default="tiny,16m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--runs", type=int, default=1, help="repeat each row this many times")
    ap.add_argument("--tools", default="msprobe,driftcheck", help="which tools to run")
    ap.add_argument("--worker", nargs=3, metavar=("SIZE", "TOOL", "MODE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(_worker(*a.worker, a.steps, a.threads)))
        return
    sizes = ["tiny"] if a.quick else [s for s in a.sizes.split(",") if s]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        sys.exit(f"peers.py: unknown size {bad[0]!r}; choose from {', '.join(SIZES)}")
    tools = set(a.tools.split(","))
    missing = _msprobe_missing() if "msprobe" in tools else None
    if missing:
        print(missing)
    rows = []
    for size in sizes:
        for tool, mode in RUNS:
            if tool not in tools or (tool == "msprobe" and missing):
                continue
            ratios = []
            for _ in range(a.runs):
                cmd = [sys.executable, __file__, "--worker", size, tool, mode,
                       "--steps", str(a.steps), "--threads", str(a.threads)]
                r = subprocess.run(cmd, capture_output=True, text=True)
                got = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
                if r.returncode or not got:
                    tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
                    print(f"{size} {tool} {mode}: failed ({tail})")
                    break
                ratios.append(json.loads(got[0][len("RESULT "):]))
            if ratios:
                rows.append(ratios)
                print(f"{size:5s} {tool:10s} {mode:15s} " + " / ".join(
                    f"{x['ratio']:.2f}x ({x['ratio_finish']:.2f}x with finish)" for x in ratios),
                    flush=True)
    full = [r for rs in rows for r in rs if r["tool"] == "driftcheck" and r["mode"] == "full"]
    if full:
        # Full mode against the disk: the bytes a traced step writes over what tracing adds to
        # the step (finishing the trace included), beside the disk's own sequential write
        # bandwidth of as many fresh bytes, fsync included, in the same directory, now.
        import torch

        sys.path.insert(0, str(HERE))
        from _common import disk_write_bandwidth

        work = Path(tempfile.mkdtemp(prefix="dc-peers-disk-", dir=os.environ.get("PEERS_DIR")))
        try:
            mb = max(int(max(r["mb_per_step"] for r in full)), 64)
            g = torch.Generator().manual_seed(0)
            bufs = [torch.randn(4 << 20, generator=g) for _ in range(max(mb // 16, 1))]
            buffered = max(disk_write_bandwidth(work, bufs) for _ in range(2)) / 1e6
            direct = max(disk_write_bandwidth(work, bufs, direct=True) for _ in range(2)) / 1e6
        finally:
            shutil.rmtree(work, ignore_errors=True)
        disk = max(buffered, direct)  # the disk's best: full mode writes direct where it can
        print(f"\ndisk: {disk:.0f} MB/s sequential write with fsync ({len(bufs) * 16} MiB of fresh data, "
              f"best of 2, same directory; buffered {buffered:.0f} MB/s, direct I/O {direct:.0f} MB/s)")
        for r in full:
            extra = r["traced_s"] + r["finish_s"] / a.steps - r["untraced_s"]
            rate = r["mb_per_step"] / extra if extra > 0 else float("inf")
            print(f"llama-{r['size']} full: {r['mb_per_step']:.0f} MB a step in {extra:.2f} s added "
                  f"(with finishing): {rate:.0f} MB/s, {100 * rate / disk:.0f}% of the disk's")
    print("\n| model | tool | mode | untraced step | traced step | ratio | ratio with finish "
          "| tensors per step | MB per step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rs in rows:
        x = rs[0]

        def each(key: str, fmt: str) -> str:
            return " / ".join(fmt.format(y[key]) for y in rs)
        print(f"| llama-{x['size']} | {x['tool']} | {x['mode']} | "
              f"{each('untraced_s', '{:.3f} s')} | {each('traced_s', '{:.3f} s')} | "
              f"{each('ratio', '{:.2f}x')} | {each('ratio_finish', '{:.2f}x')} | "
              f"{x['tensors_per_step']:.0f} | {x['mb_per_step']:.2f} |")


if __name__ == "__main__":
    main()
