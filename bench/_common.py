"""Shared pieces of the benchmarks: the two Llama sizes, timing, a disk and a memcpy baseline.

Every benchmark prints ratios of two things measured in the same run on the same machine, so
the numbers mean something on any host: absolute times depend on the CPU and the disk.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from driftcheck.scenario import Scenario  # noqa: E402
from models import llama  # noqa: E402

# ~16M parameters: 8 layers of width 384 (11 * 384^2 each) plus an 8192 x 384 tied embedding.
LLAMA_16M = dict(vocab_size=8192, seq_len=128, d_model=384, n_layer=8, n_head=6, n_kv_head=3,
                 hidden=1024, batch_size=4)


def llama_scenario(size: str, steps: int, seed: int = 0) -> Scenario:
    """The built-in tiny Llama ("tiny") or its ~16M-parameter configuration ("16m")."""
    cfg = llama.LlamaConfig(**(LLAMA_16M if size == "16m" else {}), steps=steps)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = llama.Llama(cfg)
    g = torch.Generator().manual_seed(seed)
    inputs = []
    for _ in range(steps):
        tok = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=g)
        inputs.append({"idx": tok[:, :-1].clone(), "targets": tok[:, 1:].clone()})
    return Scenario(model=model, inputs=inputs, loss=llama.loss,
                    optimizer=functools.partial(torch.optim.AdamW, lr=cfg.lr,
                                                weight_decay=cfg.weight_decay),
                    steps=steps, name=f"llama-{size}")


def llama_stats_report(work: Path, steps: int) -> Any:
    """The report of the built-in Llama over ``steps`` steps, fp32 reference against a bf16
    target, stats mode (the reports the HTML benchmarks render), recorded under ``work``."""
    from driftcheck.compare import compare
    from driftcheck.loader import load_scenario
    from driftcheck.record.runner import record

    ref = record(load_scenario("llama"), work / "ref", steps=steps, mode="stats", model_id="llama")
    tgt = record(load_scenario("llama"), work / "tgt", steps=steps, mode="stats", dtype="bf16",
                 replay=ref, model_id="llama")
    return compare(ref, tgt)


def parse_args(doc: str | None, **options: dict[str, Any]) -> argparse.Namespace:
    """A benchmark's command line: ``--quick``, ``--threads`` and ``options`` (``--name`` ->
    add_argument keywords, underscores as dashes); sets torch's intra-op threads."""
    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: steady timings on a shared host)")
    for name, kwargs in options.items():
        ap.add_argument("--" + name.replace("_", "-"), **kwargs)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def best_time(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` runs: the benchmarks compare best against best, so a shared
    host's slow moments inflate neither side of a ratio."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def disk_write_bandwidth(directory: Path, buffers: list[torch.Tensor], direct: bool = False) -> float:
    """Sequential write bandwidth (bytes/s) of ``buffers`` (the same bytes a trace holds) into a
    new file in ``directory``, fsync included: what ``dd bs=16M conv=fsync`` measures (``direct``:
    ``dd bs=16M oflag=direct conv=fsync``, from page-aligned copies of the buffers made before
    the clock starts; 0 where the file system refuses direct I/O). The same data and fresh
    files, as the trace writer gets: virtual disks treat zeros, repeated blocks and overwrites
    very differently from new data."""
    if direct:
        import mmap

        aligned = []
        for b in buffers:
            raw = b.reshape(-1).view(torch.uint8).numpy()
            m = mmap.mmap(-1, -(-raw.nbytes // 4096) * 4096)
            m[:raw.nbytes] = raw.tobytes()
            aligned.append(m)
        fd, path = tempfile.mkstemp(dir=directory, prefix="disk-bw-")
        os.close(fd)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        except OSError:
            os.unlink(path)
            return 0.0
        buffers = aligned  # type: ignore[assignment]
    else:
        fd, path = tempfile.mkstemp(dir=directory, prefix="disk-bw-")
    nbytes = 0
    try:
        t0 = time.perf_counter()
        for b in buffers:
            mv = memoryview(b) if direct else memoryview(b.reshape(-1).view(torch.uint8).numpy())
            nbytes += mv.nbytes
            while mv.nbytes:
                mv = mv[os.write(fd, mv):]
        os.fsync(fd)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return nbytes / dt


def memcpy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s of one large tensor copy (read + write of ``nbytes``, counted once)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dt = best_time(lambda: dst.copy_(src), repeats)
    return nbytes / dt


@contextlib.contextmanager
def scratch(directory: str | os.PathLike = ".") -> Iterator[Path]:
    """A temporary folder on the disk being measured (``directory``), removed afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="dc-bench-", dir=directory))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    """The benchmark's result as the Markdown table that goes into the README."""
    print()
    print(markdown_table(headers, rows))


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def fresh(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


# Issue 46's real size on one host: a 349M-parameter Hugging Face Llama, one 512-token sequence.
HF_LLAMA = {"350m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                         num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                         max_position_embeddings=512, tie_word_embeddings=False),
            "40m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                        max_position_embeddings=512, tie_word_embeddings=False)}


def hf_llama_scenario(size: str, steps: int, seed: int = 0, seq: int = 512) -> Scenario:
    """transformers' LlamaForCausalLM of ``HF_LLAMA[size]`` from its config (no download), AdamW,
    ``steps`` batches of one ``seq``-token sequence, its own causal-LM loss."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**HF_LLAMA[size])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    inputs = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)
        inputs.append({"input_ids": ids, "labels": ids.clone()})
    return Scenario(model=model, inputs=inputs, loss=lambda out, batch: out.loss,
                    optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                    steps=steps, name=f"hf-llama-{size}")
