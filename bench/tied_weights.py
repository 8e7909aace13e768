"""Tied weights on a real deferred backend: does alias.sharing_differs fire where the tie comes
apart, and nowhere else? (issue 43)

    python bench/tied_weights.py llama lm_head.weight tok_emb.weight
    python bench/tied_weights.py hf:gemma lm_head.weight model.embed_tokens.weight
    STEPS=1 python bench/tied_weights.py hf:whisper proj_out.weight model.decoder.embed_tokens.weight lazy

MODEL HEAD EMB [CASES]: a reference on CPU in fp32, then each case replaying it: ``lazy`` (the
model moved to PyTorch's lazy-tensor backend, which unties it), ``lazy_retied`` (tied again after
the move: ``tie_weights()``, or the head assigned the embedding), ``cpu_untied`` (a fault made by
hand: the head gets a copy of the embedding), ``cpu_bf16`` (a clean control). Prints each verdict,
the target's alias groups, the first divergence and the alias finding.

"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch._lazy
import torch._lazy.ts_backend
from torch import nn

from driftcheck.compare import compare
from driftcheck.loader import load_scenario
from driftcheck.record.runner import record

torch._lazy.ts_backend.init()


def main() -> None:
    spec, head, emb = sys.argv[1:4]
    out = os.path.join(os.environ.get("OUT", "/tmp/tied_weights"), spec.replace(":", "_").replace("/", "_"))
    steps = int(os.environ.get("STEPS", "2"))

    def get(m, name):
        for p in name.split("."):
            m = getattr(m, p)
        return m

    def setp(m, name, v):
        mod, _, leaf = name.rpartition(".")
        setattr(get(m, mod) if mod else m, leaf, v)

    def untie(model):
        setp(model, head, nn.Parameter(get(model, emb).detach().clone()))

    def retie(model):
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        else:
            setp(model, head, get(model, emb))
        assert get(model, head) is get(model, emb)

    def rec(name, **kw):
        t = time.time()
        record(load_scenario(spec), f"{out}/{name}", force=True, steps=steps, **kw)
        print(f"  recorded {name} in {time.time() - t:.1f}s", flush=True)

    rec("ref")
    ref = f"{out}/ref"
    cases = {"lazy": dict(device="lazy"), "lazy_retied": dict(device="lazy", target_hooks=retie),
             "cpu_untied": dict(target_hooks=untie), "cpu_bf16": dict(dtype="bf16")}
    for name in (sys.argv[4].split(",") if len(sys.argv) > 4 else list(cases)):
        rec(name, replay=ref, **cases[name])
        r = compare(ref, f"{out}/{name}")
        fd = r.first_divergence or {}
        aliases = json.load(open(f"{out}/{name}/manifest.json"))["aliases"]
        print(f"{spec} {name}: {r.verdict}; target aliases {aliases}; first divergence "
              f"{fd.get('module')} {fd.get('finding') or fd.get('slot')}; gate findings "
              f"{sorted({f.kind for f in r.findings if f.gate == 'fails gate'})}", flush=True)


if __name__ == "__main__":
    main()
