"""The kernels: one Python function for every ATen op dispatched to PrivateUse1."""
from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_map
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

NAME = "tpu"
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_DEVICE = torch.device("cpu")  # torch.device("tpu", 0) once register() has renamed PrivateUse1
# "tpu" storage (its StorageImpl address) -> (weak ref keeping the address, the CPU storage)
_STORAGES: dict[int, tuple[StorageWeakRef, torch.UntypedStorage]] = {}
_made = 0
# fp32 operands rounded to bf16 (one bf16 pass): op name -> positions of the operands
MATMULS = {
    "aten::mm": (0, 1), "aten::bmm": (0, 1), "aten::addmm": (1, 2), "aten::baddbmm": (1, 2),
    "aten::mv": (0, 1), "aten::dot": (0, 1), "aten::addmv": (1, 2), "aten::addbmm": (1, 2),
    "aten::convolution": (0, 1), "aten::convolution_backward": (0, 1, 2),
}
counts: dict[str, int] = {}  # matmul-like ops computed in one bf16 pass, by name
# PYTPU_MATMUL=fp32: matmuls as the CPU computes them (a control: the backend's other kernels are
# the CPU's, so such a target must match a CPU reference bitwise up to reduction order)
ONE_BF16_PASS = os.environ.get("PYTPU_MATMUL", "bf16").strip().lower() != "fp32"


def _prune() -> None:
    for key in [k for k, (ref, _) in _STORAGES.items() if ref.expired()]:
        del _STORAGES[key]


def _tpu_storage(cpu: torch.UntypedStorage) -> torch.UntypedStorage:
    """A "tpu" storage over ``cpu``'s bytes: same address and size, owning nothing (the table
    keeps ``cpu`` alive as long as the "tpu" storage lives)."""
    global _made
    storage = torch._C._construct_storage_from_data_pointer(cpu.data_ptr(), _DEVICE, cpu.nbytes())
    _STORAGES[storage._cdata] = (StorageWeakRef(storage), cpu)
    _made += 1
    if _made % 2000 == 0:
        _prune()
    return storage


def _place(t: torch.Tensor, storage: torch.UntypedStorage, raw: torch.Tensor) -> None:
    """Point ``t`` at ``storage`` with ``raw``'s sizes, strides and offset (the CPU kernel of
    set_: it only sets metadata, checked against the storage's size)."""
    torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
        _CPU, t, storage, raw.storage_offset(), raw.shape, raw.stride())


def _wrap(raw: torch.Tensor) -> torch.Tensor:
    """A new "tpu" tensor whose bytes are ``raw``'s storage, with ``raw``'s layout."""
    out = torch._C._acc.create_empty_tensor(list(raw.shape), raw.dtype)
    _place(out, _tpu_storage(raw.untyped_storage()), raw)
    return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The CPU view of a "tpu" tensor: its storage's CPU bytes, its own sizes and strides."""
    entry = _STORAGES.get(t.untyped_storage()._cdata)
    if entry is None:
        raise RuntimeError("pytpu: a 'tpu' tensor whose storage pytpu did not make")
    cpu = torch.empty(0, dtype=t.dtype)
    return cpu.set_(entry[1], t.storage_offset(), t.shape, t.stride())


def _is_ours(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == NAME


def _unwrap(x: Any) -> Any:
    if _is_ours(x):
        return _raw(x)
    if isinstance(x, torch.UntypedStorage) and x.device.type == NAME:
        return _STORAGES[x._cdata][1]
    if isinstance(x, torch.device) and x.type == NAME:
        return torch.device("cpu")
    if isinstance(x, str) and x.split(":")[0] == NAME:
        return "cpu"
    return x


def _bf16_pass(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
        return x.to(torch.bfloat16).to(torch.float32)
    return x


def _sync_layout(wrapper: torch.Tensor, raw: torch.Tensor, sources: list[torch.UntypedStorage]) -> None:
    """After an in-place op changed ``raw``'s layout (resize_, as_strided_, set_ ...)."""
    mine = wrapper.untyped_storage()
    cpu = raw.untyped_storage()
    if _STORAGES[mine._cdata][1]._cdata != cpu._cdata:
        # set_ to other bytes: the "tpu" storage holding them, or a new one
        owner = next((s for s in sources if _STORAGES[s._cdata][1]._cdata == cpu._cdata), None)
        _place(wrapper, owner if owner is not None else _tpu_storage(cpu), raw)
    elif (mine.nbytes(), mine.data_ptr()) != (cpu.nbytes(), cpu.data_ptr()):
        _place(wrapper, _tpu_storage(cpu), raw)  # resized: the bytes moved
    elif (wrapper.shape, wrapper.stride(), wrapper.storage_offset()) != (
            raw.shape, raw.stride(), raw.storage_offset()):
        _place(wrapper, mine, raw)


def _alias_of(raw_out: torch.Tensor, wrappers: list[torch.Tensor]) -> torch.Tensor | None:
    key = raw_out.untyped_storage()._cdata
    for w in wrappers:
        if _STORAGES[w.untyped_storage()._cdata][1]._cdata == key:
            return w
    return None


def _kernel(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    name = op._schema.name
    to_host = False
    if "device" in kwargs and kwargs["device"] is not None:
        to_host = torch.device(kwargs["device"]).type != NAME
    if name == "aten::_fused_sdp_choice":
        return int(torch.nn.attention.SDPBackend.MATH)  # attention as matmuls: one bf16 pass each
    flat_in = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if _is_ours(a)]
    raw_args, raw_kwargs = tree_map(_unwrap, (args, kwargs))
    if name in MATMULS and ONE_BF16_PASS:
        counts[name] = counts.get(name, 0) + 1
        raw_args = [_bf16_pass(a) if i in MATMULS[name] else a for i, a in enumerate(raw_args)]
    out = op(*raw_args, **raw_kwargs)
    writes = [r.alias_info is not None and r.alias_info.is_write for r in op._schema.returns]
    views = [r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns]
    # arguments written in place: their new layout goes back to the "tpu" tensor
    sources = [a if isinstance(a, torch.UntypedStorage) else a.untyped_storage()
               for a in torch.utils._pytree.tree_leaves((args, kwargs))
               if _is_ours(a) or (isinstance(a, torch.UntypedStorage) and a.device.type == NAME)]
    for position, schema_arg in enumerate(op._schema.arguments):
        if schema_arg.alias_info is None or not schema_arg.alias_info.is_write:
            continue
        if schema_arg.kwarg_only or position >= len(args):
            arg, raw_arg = kwargs.get(schema_arg.name), raw_kwargs.get(schema_arg.name)
        else:
            arg, raw_arg = args[position], raw_args[position]
        if _is_ours(arg) and isinstance(raw_arg, torch.Tensor):
            _sync_layout(arg, raw_arg, sources)
    single = len(op._schema.returns) == 1
    outs = [out] if single else list(out) if isinstance(out, (tuple, list)) else [out]

    def convert(i: int, o: Any) -> Any:
        if not isinstance(o, torch.Tensor) or to_host or o.device.type != "cpu":
            return o
        if i < len(writes) and writes[i]:
            for arg in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(arg, torch.Tensor) and not _is_ours(arg) and arg is o:
                    return arg  # a CPU tensor written in place (cpu_tensor.copy_(tpu_tensor))
            owner = _alias_of(o, flat_in)
            if owner is not None and (owner.shape, owner.stride()) == (o.shape, o.stride()):
                return owner
        if i < len(views) and views[i]:
            owner = _alias_of(o, flat_in)
            if owner is not None:
                return torch.ops.aten.as_strided.default.redispatch(
                    _CPU, owner, o.shape, o.stride(), o.storage_offset())
        return _wrap(o)

    converted = [tree_map(functools.partial(convert, i), o) for i, o in enumerate(outs)]
    if single:
        return converted[0]
    return type(out)(converted) if isinstance(out, (tuple, list)) else converted[0]


class _Module:
    """``torch.tpu``: what torch and driftcheck ask of a backend module."""

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def _is_in_bad_fork(self) -> bool:
        return False

    # the kernels draw from the CPU generator: the device's RNG is the CPU's
    def manual_seed_all(self, seed: int) -> None:
        pass  # called by torch.manual_seed, which has seeded the CPU generator already

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.random.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        torch.random.set_rng_state(state)

    def synchronize(self, device: Any = None) -> None:
        pass

    def get_device_name(self, index: int = 0) -> str:
        matmuls = "fp32 matmuls in one bf16 pass" if ONE_BF16_PASS else "fp32 matmuls as the CPU's"
        return f"pytpu (CPU kernels, {matmuls})"

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.bfloat16]


_LIB: torch.library.Library | None = None


def register() -> None:
    """Rename PrivateUse1 to "tpu" and give every ATen op a PrivateUse1 kernel."""
    global _LIB
    module = _Module()
    module.__module__ = __name__
    _setup_privateuseone_for_python_backend(NAME, backend_module=module)
    global _DEVICE
    _DEVICE = torch.device(NAME, 0)
    _LIB = torch.library.Library("_", "IMPL")
    _LIB.fallback(_kernel, "PrivateUse1")
    # Ops with a CompositeExplicitAutograd kernel would run it on the storage (CPU memory under a "tpu" tag) instead of
    # the fallback: they get the same kernel as a direct registration.
    explicit = ("CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")
    aten = torch.library.Library("aten", "IMPL")
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::") or torch._C._dispatch_has_kernel_for_dispatch_key(
                qualified, "PrivateUse1"):
            continue
        if not any(torch._C._dispatch_has_kernel_for_dispatch_key(qualified, k) for k in explicit):
            continue
        base, _, overload = qualified[len("aten::"):].partition(".")
        packet = getattr(torch.ops.aten, base, None)
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if op is None or any(r.alias_info is not None and not r.alias_info.is_write
                             for r in op._schema.returns):
            continue  # views: C++ makes them on the same storage (no Python object)
        aten.impl(op, functools.partial(_kernel, op), "PrivateUse1")
    global _ATEN
    _ATEN = aten


_ATEN: torch.library.Library | None = None
