"""The step's host transfer: what ``Capture.flush`` does to a step's pending captures once
their statistics are taken: deferred devices' data onto the host, one transfer per dtype, the
stats-mode samples packed into one block, the device-side meta read into the manifest entries."""
from __future__ import annotations

import math
from typing import Any

import torch

from driftcheck.store.buffers import mapped_empty
from driftcheck.store.format import SHARES
from driftcheck.targets import deferred

Pending = Any  # record/capture.py's Pending (its import here would be a cycle)


def apply_meta(pending: list[Pending], metas: list[tuple[int, str, torch.Tensor]],
                values: list[float]) -> None:
    """The device-side meta, read back (``values``, in ``metas`` order), into the entries."""
    at = 0
    for i, k, dev in metas:
        n = dev.numel()
        v = values[at:at + n]
        at += n
        if k == "mag_sq":
            pending[i].entry.setdefault("meta", {})["mag_rms"] = math.sqrt(max(v[0], 0.0))
        elif k == "norm_gain_sq":
            meta = pending[i].entry.setdefault("meta", {})
            meta["norm_gain"] = math.sqrt(max(v[0], 1.0))
            meta["norm_gain_max"] = math.sqrt(max(v[-1], 1.0))
        elif k.endswith("_sample") and k[:-7] in SHARES:  # record/parts.py: a share of the logical sample
            pending[i].entry["meta"][k[:-7]]["values"] = [x if math.isfinite(x) else repr(x) for x in v]
        elif k == "logit_absmax":
            pending[i].entry.setdefault("meta", {})[k] = float(v[0])
        else:  # kink_profile: counts
            pending[i].entry.setdefault("meta", {})[k] = [int(c) for c in v]


def pack_samples(host: list[torch.Tensor], fulls: list[bool]) -> None:
    """Replace a step's samples by views into one block per dtype, in place. Stats-mode samples
    wait in the writer until their shard fills (tens of steps); held one by one, thousands of
    small allocations between the model's large ones fragment the allocator's heap, and a
    16M-parameter model's resident memory grew ~200 MB a step (and its steps slowed) until
    the shard was written. One block per step is one allocation, freed as a whole."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (t, full) in enumerate(zip(host, fulls)):
        if not full and t is not None and t.is_cpu and t.numel():
            by_dtype.setdefault(t.dtype, []).append(i)
    for idxs in by_dtype.values():
        if len(idxs) < 2:  # alone: copied out where it is a view into a larger block
            t = host[idxs[0]]
            if t.untyped_storage().nbytes() > t.numel() * t.element_size():
                host[idxs[0]] = t.clone()
            continue
        parts = [host[i].reshape(-1) for i in idxs]
        # mapped on its own (store/buffers.py): a block held for many steps inside malloc's
        # heap would pin it between the model's tensors
        block = torch.cat(parts, out=mapped_empty((sum(p.numel() for p in parts),), parts[0].dtype))
        for i, part in zip(idxs, block.split([host[i].numel() for i in idxs])):
            host[i] = part.view(host[i].shape)


def off_deferred(pending: list[Pending]) -> None:
    """The captures of a deferred device, and their device-side meta, onto the host in place:
    their graphs run together where any is still pending (after the step's mark_step, none
    is), then each one's data is copied (a transfer of data the device holds: no graph runs)."""
    held = [p.tensor for p in pending if p.tensor.device.type in deferred.DEFERRED_TYPES]
    held += [v for p in pending for v in (p.dev_meta or {}).values()
             if v.device.type in deferred.DEFERRED_TYPES]
    if not held:
        return
    deferred.materialise(held)
    for p in pending:
        p.tensor = p.tensor.cpu()
        if p.dev_meta:
            p.dev_meta = {k: v.cpu() for k, v in p.dev_meta.items()}


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One device-to-host transfer per dtype for all tensors (none on CPU)."""
    if not tensors or all(t.device.type == "cpu" for t in tensors):
        return tensors
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idxs in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in idxs]).cpu()
        offset = 0
        for i in idxs:
            n = tensors[i].numel()
            out[i] = flat[offset:offset + n].reshape(tensors[i].shape).clone()
            offset += n
    return out  # type: ignore[return-value]
