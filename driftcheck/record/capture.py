"""Taking captures: each tensor copied (or summarised) at hook time, then moved to the host in
one batched transfer per step and handed to the writer (``Capture``, owned by the Tracer).

The cost of ``_capture`` is stats mode's overhead on a small model: plain tuples, cached names,
no context managers on its fast path.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from driftcheck.numerics import dtypes, stats as tstats
from driftcheck.record import transfer
from driftcheck.record.config import CaptureConfig
from driftcheck.record.copies import Copies, Same
from driftcheck.record.host_summaries import Held, HostSummaries
from driftcheck.record.parts import Parts, dtensor_layout
from driftcheck.record.selection import Selection
from driftcheck.store.keys import key_string, sample_key
from driftcheck.store.writer import TraceWriter
from driftcheck.targets import deferred

# On the host a flush is no sync point: captures go to the writer once this much waits, so
# writing a full-mode step overlaps the step instead of starting at its end.
HOST_FLUSH_BYTES = 64 << 20


# (stats row, sample) taken at hook time, or both held (record/host_summaries.py) till the flush
Summary = tuple[Any, torch.Tensor | None] | Held


class Pending:
    """A capture waiting for the step's host transfer: its manifest entry, what it holds (the
    copy, or the sample), its device-side meta, and its (stats row, sample) where taken early."""

    __slots__ = ("dev_meta", "entry", "summary", "tensor")

    def __init__(self, entry: dict[str, Any], tensor: torch.Tensor,
                 dev_meta: dict[str, torch.Tensor] | None, summary: Summary | None = None) -> None:
        self.entry = entry
        self.tensor: Any = tensor  # None once handed to the writer
        self.dev_meta = dev_meta
        self.summary: Any = summary  # (stats row, sample) or a Held, taken at hook time, not a copy


_NOTHING = torch.empty(0)  # what a Same stands as in the flush's host transfer

# The CRC32C of a full-mode copy's bytes, taken in the pass that made it (``stats.copy_row``),
# as an attribute of that tensor object: the writer then does not read the copy again for it.
CHECKSUM = "_driftcheck_crc32c"



Known = tuple[Any, ...]  # (weak ref, identity, row, sample key, sample) of a summarised tensor


class Capture:
    """The captures of the step being traced, on their way to the writer.

    Args:
        writer: where captures go.
        selection: which modules keep full tensors (``Selection.full``), which phases of
            which steps are captured (``wants``).
        config: the seed of the samples, the transfer mode and the bytes that may wait.
    """

    def __init__(self, writer: TraceWriter, selection: Selection, config: CaptureConfig) -> None:
        self.writer = writer
        self.selection = selection
        self.seed = config.seed
        self.transfer = config.transfer
        self.max_pending_bytes = config.max_pending_bytes
        self.step = 0  # the step being traced
        self.audit: Any = None  # a ViewAudit dispatch mode, when the view audit is on
        self.order = 0  # execution order of the step's captures
        self.pending: list[Pending] = []
        self.pending_bytes = 0
        # On a deferred device (lazy, xla) nothing is read inside a step: copies wait on the
        # device for the step's own mark_step (the tracer's), then move to the host.
        self.deferred = False
        self.host_now = False  # between a deferred device's steps: captures go to the host now
        self._host = HostSummaries(config.seed)
        self._copies = Copies()
        # module path -> the layout of a plain tensor there that is a tensor-parallel shard (record/tensor_parallel.py)
        self.shards: dict[str, Callable[[str, str, torch.Tensor], dict[str, Any] | None]] = {}
        self.batch: tuple[int, int] | None = None  # fsdp-tp: this rank's data-parallel group, of how many
        self.parts: Parts | None = None  # a rank of a multi-rank stats record: its parts' shares
        self.reset()

    def reset(self) -> dict[int, Known]:
        """A new step: its order, keys and summaries start empty; returns the step before's
        summaries (``carry`` them to the parameters captured after the update)."""
        known = getattr(self, "_summaries", {})
        self.order = 0
        self._seen_keys: set[str] = set()
        self._summaries: dict[int, Known] = {}  # id -> (ref, identity, row, key, sample)
        self._carried: dict[int, Known] = {}  # the step before's, for its parameters
        self._copies.clear()  # the step's full-mode copies, by where their data lies
        return known

    def carry(self, known: dict[int, Known] | None) -> None:
        """Summaries (and full mode's copies) of the step before that a parameter unchanged
        since may reuse (None: none)."""
        self._carried = known or {}
        self._copies.carry(known is not None)

    def wants(self, phase: str) -> bool:
        """Whether ``phase`` of the step being traced is captured."""
        return self.selection.phase(phase, self.step)

    def quiet(self) -> Any:
        """The tracer's own copies must not show up in the view/in-place audit."""
        return self.audit.paused() if self.audit is not None else contextlib.nullcontext()

    @staticmethod
    def _identity(t: torch.Tensor) -> tuple | None:
        """What makes a tensor the same data as when last seen: the object itself (held weakly,
        so a freed tensor's id or memory can never match), its version counter (bumped by every
        in-place write) and its view geometry."""
        try:
            return (t._version, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)
        except RuntimeError:  # inference tensors have no version counter
            return None

    def _known_summary(self, t: torch.Tensor) -> Any:
        """The stats row of ``t`` if this step already summarised this very tensor, unchanged
        (a module's output is the next module's input, a parent's output its last child's)."""
        known = self._summaries.get(id(t))
        if known is None:
            return None
        ref, ident, row = known[:3]
        return row if ref() is t and ident is not None and ident == self._identity(t) else None

    def _carried_summary(self, t: torch.Tensor, data: torch.Tensor) -> Any:
        """The stats row of ``t`` from the step before (a parameter before this step is the one
        after the last update) if it is the same tensor, unchanged by any tracked write, and its
        sample there is still what it holds: a write through ``.data`` bumps no version counter,
        and any write that touches many elements (a clamp, a re-initialisation) shows there."""
        known = self._carried.get(id(t))
        if known is None or known[0]() is not t or known[1] is None \
                or known[1] != self._identity(t):
            return None
        row, skey, sample = known[2:]
        if isinstance(sample, Held):
            sample = sample.sample()
        again = self._host.sample(data, skey) if HostSummaries.eligible_large(data) \
            else tstats.large_sample(data, skey, self.seed)
        return row if again.shape == sample.shape and torch.equal(again, sample.to(again)) else None

    def _remember_summary(self, t: torch.Tensor, row: Any, skey: str | None = None,
                          sample: torch.Tensor | Held | None = None) -> None:
        try:
            self._summaries[id(t)] = (weakref.ref(t), self._identity(t), row, skey, sample)
        except TypeError:  # not weak-referenceable: never reused
            pass

    def __call__(self, module: str, phase: str, call: int, slot: str, t: torch.Tensor, *,
                 extra: dict[str, Any] | None = None, copy: bool = True,
                 dev_meta: dict[str, torch.Tensor] | None = None,
                 summary: Summary | None = None) -> None:
        """Capture ``t`` as the entry (step, phase, module, call, slot): copied or summarised
        now, moved to the host at the next ``flush``. ``copy=False``: ``t`` is the tracer's
        own already. ``summary``: its (stats row, sample), taken earlier."""
        # Runs ~10^2-10^3 times a step: the cost of this function is stats mode's overhead on a
        # small model, hence plain tuples, cached names and no context managers on its fast path.
        if type(t) is not torch.Tensor and hasattr(t, "placements") and hasattr(t, "to_local"):
            # An FSDP/tensor-parallel DTensor: record this rank's shard. Anything else (stats,
            # .cpu()) would run collectives from inside a hook and could deadlock the ranks.
            # compare_ranks judges what depends on it with the whole tensor's error (meta shard).
            extra = dict(extra or {}, shard=True, layout=dtensor_layout(
                t, self.batch if phase in ("forward", "backward") else None))
            t = t.to_local()
        elif self.shards and module in self.shards:
            layout = self.shards[module](phase, slot, t)  # a local shard a TP style handed over
            if layout is not None:
                extra = dict(extra or {}, shard=True, layout=layout)
        if dev_meta and any(type(v) is not torch.Tensor for v in dev_meta.values()):
            # operand magnitudes of a tensor-parallel call (DTensor weights): the whole tensor's,
            # a collective every rank makes at the same hook (TP ranks run the same calls)
            dev_meta = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                        for k, v in dev_meta.items()}
        if t.layout != torch.strided:  # a sparse gradient (nn.Embedding(sparse=True)): dense
            t = t.to_dense()
        skey = key_string(self.step, phase, module, call, slot)
        if skey in self._seen_keys:
            return  # the same tensor reached twice (e.g. an output hook fired twice)
        entry: dict[str, Any] = {
            "key": skey, "module": module, "phase": phase, "step": self.step,
            "call": call, "slot": slot, "order": self.order, "shape": list(t.shape),
            "dtype": dtypes.name_of(t.dtype), "stats": {},
        }
        if extra:
            entry["meta"] = dict(extra)
        self.order += 1
        data: Any = t.detach()  # no autograd history: what follows records no graph (or a Held)
        if not copy and CHECKSUM in t.__dict__:  # the tracer's own copy, its checksum taken
            setattr(data, CHECKSUM, t.__dict__[CHECKSUM])
        # A local replay's sample holds the positions of the entry it replays: the same key.
        # A parameter or buffer after the update, those of the same tensor before it: the
        # sample difference is then the step's own update (compare's optimizer floor).
        sk = sample_key(self.step, phase, module, call, slot)
        if sk != skey:
            entry["sample_key"] = sk
            if phase == "optimizer":
                entry.setdefault("meta", {})["sampled_as"] = "params"
        if self.parts is not None and not data.is_complex() and phase != "loss" \
                and not self.selection.full(module):
            dev_meta = self._share(entry, data, sk, dev_meta)
        if isinstance(summary, Held):  # taken earlier, held
            data = summary
        elif summary is not None:  # (stats row, sample) taken earlier: only the sample is held
            data = summary[1] if summary[1] is not None else data  # (row, None): ``t`` is a copy
        elif not self.deferred and (phase == "loss" or self.selection.full(module)) \
                and (same := self._copies.same(data)) is not None:
            summary, data = same.summary, same
            self._copies.remember(t, same.first, same.summary, same.checksum)  # (a frozen weight)
        else:
            if self.audit is None:
                summary, data = self.take(data, t, module, phase, sk, copy)
            else:
                with self.audit.paused():  # the tracer's own ops stay out of the view audit
                    summary, data = self.take(data, t, module, phase, sk, copy)
            if copy and type(summary) is tuple and summary[1] is None and CHECKSUM in data.__dict__:
                self._copies.remember(t, entry, summary, data.__dict__[CHECKSUM])  # a copy made now, the trace keeps
        self.pending.append(Pending(entry, data, dev_meta, summary))
        self.pending_bytes += data.nbytes
        self._seen_keys.add(skey)
        if self.transfer == "per-capture" or (not self.deferred and (
                self.pending_bytes > self.max_pending_bytes
                or (self.pending_bytes > HOST_FLUSH_BYTES and (type(data) is Held or data.is_cpu)))):
            self.flush()

    def _share(self, entry: dict[str, Any], data: torch.Tensor, skey: str,
               dev_meta: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        """Meta ``part`` (and ``part_tp``): this rank's shares of the logical sample
        (record/parts.py), their values gathered on the device and read back with the other
        device meta."""
        if self.parts is None or (self.deferred and data.device.type in deferred.DEFERRED_TYPES):
            return dev_meta  # lazy/xla: a gather here would be a graph per step and rank (none kept)
        for name, part, values in self.parts.shares_of(entry, data, skey):
            entry.setdefault("meta", {})[name] = part
            dev_meta = dict(dev_meta or {}, **{name + "_sample": values})
        return dev_meta

    def take(self, data: torch.Tensor, t: torch.Tensor, module: str, phase: str, skey: str,
              copy: bool) -> tuple[Summary | None, torch.Tensor | Held]:
        """(summary or None, what the pending capture holds) for detached ``data`` of ``t``."""
        keep = phase == "loss" or self.selection.full(module)  # the whole tensor goes to the trace
        if self.deferred and data.device.type in deferred.DEFERRED_TYPES:
            # a statistic or sample read now would run the step's graph up to here: a copy only
            # (an op in the step's graph), summarised on the host after the step's sync point
            if self.host_now:  # after the step's sync point: the data it made, copied now
                with torch.no_grad():  # of ``t`` itself: a detach() would be a graph to run
                    return None, t.cpu().detach()
            return None, deferred.copy(data) if copy else data
        if not keep and HostSummaries.eligible(data):
            held = self._host.take(data, skey)
            if held is not None:  # Stats mode, a small host tensor: summarised now, held
                return held, held
        if not keep and data.numel() >= tstats.BIG:
            # Stats mode, a large tensor: summarise it now (on its device, no sync) rather
            # than copy it for later; the copy would cost more than the summary.
            row: Any = self._known_summary(t)  # a device row, a numpy row or a Held
            if row is None and self._carried:
                row = self._carried_summary(t, data)
            host = HostSummaries.eligible_large(data)
            if row is None:
                got = self._host.take_large(data, skey) if host else None
                if got is not None:
                    self._remember_summary(t, got, skey, got)
                    return got, got
                sample: Any  # (a sample is always made: a key is given)
                if host:  # not all finite: the exact path (take_large made the one-pass row)
                    rows, samples = tstats.summarize([data], [skey], self.seed)
                    row, sample = rows[0], samples[0]
                else:
                    row, sample = tstats.summarize_one(data, skey, self.seed)
                self._remember_summary(t, row, skey, sample)
            elif host and not isinstance(row, torch.Tensor):  # the same tensor, unchanged,
                held = self._host.take_sample(data, skey, row)  # seen earlier: only the sample
                return held, held
            else:
                sample = tstats.large_sample(data, skey, self.seed)
            return (row, sample), sample
        # copy at hook time: later in-place ops must not leak in. A copy the trace stores whole
        # goes into memory the writer recycles (store/buffers.py); one only summarised at the
        # end of the step is never handed to the writer: a plain clone.
        if not copy:
            return None, data
        if not keep:
            return None, data.clone()
        kept = None
        if data.numel() >= tstats.BIG and data.device.type == "cpu" and data.is_contiguous() \
                and data.dtype in (torch.float32, torch.float64) and type(data) is torch.Tensor \
                and not data.is_neg():
            kept = self.writer.buffers.empty_like(data)
        if kept is None:
            return None, self.writer.buffers.copy(data)
        # The copy and its statistics in one pass over the source, while it is in cache, not a
        # second pass over the cold copy at the end of the step. Where the values are not all
        # finite, the row is left to the exact path there (the copy is made all the same).
        row, checksum = tstats.copy_row(data, kept)
        setattr(kept, CHECKSUM, checksum)  # on this tensor object alone: it dies with it
        return (None if row is None else (row, None)), kept

    def flush(self) -> None:
        """Move pending captures to the host in one batched transfer and hand them to the writer."""
        if not self.pending:
            return
        pending, self.pending, self.pending_bytes = self.pending, [], 0
        for p in pending:
            if type(p.summary) is Held:  # made now: (row, sample) for the paths below
                p.summary = (p.summary.row(), p.summary.sample())
                p.tensor = p.summary[1]
        if self.deferred:
            with torch.no_grad(), self.quiet():
                transfer.off_deferred(pending)
        with torch.no_grad(), self.quiet():
            fulls = [self.selection.full(p.entry["module"]) or p.entry["phase"] == "loss"
                     for p in pending]
            rows, order, samples, stat_lists = self._rows(pending, fulls)
            metas = [(i, k, v) for i, p in enumerate(pending) if p.dev_meta
                     for k, v in p.dev_meta.items()]
            meta_vals = torch.cat([v.to(tstats.acc_dtype(v.device)).reshape(-1)
                                   for _, _, v in metas]) if metas else None
            # (a Same holds no tensor: kept out of the transfer, put back after it)
            host_tensors = transfer.to_host([_NOTHING if type(p.tensor) is Same else p.tensor if f else s
                                             for p, f, s in zip(pending, fulls, samples)])
            host_tensors = [p.tensor if type(p.tensor) is Same else h  # type: ignore[misc]
                            for p, h in zip(pending, host_tensors)]
            transfer.pack_samples(host_tensors, fulls)
            for i, row in zip(order, rows.cpu().tolist() if order else []):
                stat_lists[i] = row
            meta_host = meta_vals.cpu().tolist() if meta_vals is not None else []
        transfer.apply_meta(pending, metas, meta_host)
        # each copy handed over held by the writer alone: its memory comes back to the writer's
        # pool once written (store/buffers.py), also while this loop still runs
        todo: list[Any] = pending
        hosts: list[Any] = host_tensors
        for i, (row, full) in enumerate(zip(stat_lists, fulls)):
            p, host = todo[i], hosts[i]
            todo[i] = hosts[i] = p.tensor = None
            p.entry.pop("sample_key", None)  # the positions are the replayed entry's
            p.entry["stats"] = tstats.to_dict(row)
            if type(host) is Same:
                self.writer.add(p.entry, None, same=host.first)
            elif full:
                self.writer.add(p.entry, host, checksum=getattr(host, CHECKSUM, None))
            else:
                self.writer.add(p.entry, None, sample=host)

    def _rows(self, pending: list[Pending], fulls: list[bool]
              ) -> tuple[Any, list[int], list[Any], list[Any]]:
        """(the device rows of the captures in ``order``, that order, each capture's sample,
        each one's stats list where already on the host)."""
        # Stats of all captures and the samples of the non-full ones, a few kernels per dtype,
        # except those summarised in their hook (rows on the host or on the device).
        todo = [i for i, p in enumerate(pending) if p.summary is None]
        rows, got = tstats.summarize(
            [pending[i].tensor for i in todo],
            [None if fulls[i] else pending[i].entry.get("sample_key", pending[i].entry["key"])
             for i in todo], self.seed)
        samples: list[Any] = [p.summary[1] if p.summary else None for p in pending]
        for j, i in enumerate(todo):
            samples[i] = got[j]
        stat_lists: list[Any] = [None] * len(pending)
        on_device: list[tuple[int, torch.Tensor]] = []
        for i, p in enumerate(pending):
            if p.summary is not None:
                if isinstance(p.summary[0], torch.Tensor):
                    on_device.append((i, p.summary[0]))
                else:  # a HostSummaries row: on the host already
                    stat_lists[i] = p.summary[0].tolist()
        if on_device:
            like = rows if todo else on_device[0][1]
            extra = torch.stack([row.to(like) for _, row in on_device])
            rows = torch.cat([rows, extra]) if todo else extra
        return rows, todo + [i for i, _ in on_device], samples, stat_lists
