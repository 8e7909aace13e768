"""What ``--emulate tpu`` costs per training step: the same untraced step (forward, backward,
AdamW update) of the tiny and the 16M-parameter Llama, plain fp32 against each TPU level, best
of N in one run.

    python bench/emulation_cost.py            # tiny and 16m, 5 repeats of 3 steps
    python bench/emulation_cost.py --quick    # tiny only

Each level computes every fp32 matmul and convolution from 1, 3 or 6 bf16 passes in fp32
(driftcheck/targets/emulate.py), plus a Python dispatch per aten op while the mode is on.
"""
from __future__ import annotations

import contextlib
import copy

from _common import best_time, llama_scenario, markdown_table, params, parse_args

from driftcheck.targets.emulate import LEVELS, emulate_tpu


def step_time(scenario, level: str | None, repeats: int) -> float:
    model = copy.deepcopy(scenario.model)
    opt = scenario.optimizer(model.parameters())

    def run() -> None:
        with emulate_tpu(level) if level else contextlib.nullcontext():
            for batch in scenario.inputs:
                loss = scenario.loss(model(**batch) if isinstance(batch, dict) else model(batch), batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

    run()  # warm up
    return best_time(run, repeats) / len(scenario.inputs)


def main() -> int:
    args = parse_args(__doc__, repeats={"type": int, "default": 5, "help": "timed repeats (best of)"})
    rows = []
    for size in (["tiny"] if args.quick else ["tiny", "16m"]):
        sc = llama_scenario(size, steps=3)
        base = step_time(sc, None, args.repeats)
        rows.append([f"llama-{size} ({params(sc.model) / 1e6:.1f}M)", "fp32 (no emulation)",
                     f"{base * 1e3:.1f} ms", "1.00x"])
        for level in LEVELS:
            t = step_time(sc, level, args.repeats)
            rows.append([f"llama-{size} ({params(sc.model) / 1e6:.1f}M)", f"tpu {level}",
                         f"{t * 1e3:.1f} ms", f"{t / base:.2f}x"])
    print(markdown_table(["model", "matmuls", "step", "ratio"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
