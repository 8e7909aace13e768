"""Tensor parallelism of a record (``--parallel tp`` under torchrun): the model's plan applied on a
1-D device mesh of all ranks, and the layout of the activations the plan leaves as plain local
shards.

    torchrun --nproc_per_node 2 -m driftcheck record llama --out tgt --parallel tp --replay ref

The plan maps module paths (``*`` matches one path component, as in Hugging Face's
``base_model_tp_plan``) to a style: ``"colwise"`` (``ColwiseParallel``: the weight split along
its output features, the output left as this rank's part of the last dim), ``"rowwise"``
(``RowwiseParallel``: the weight split along its input features, the input taken as this rank's
part of the last dim, the output all-reduced), ``"colwise_rep"`` (colwise, the output gathered:
replicated; Hugging Face's ``"colwise_gather_output"``), ``"embedding_rowwise"`` (an
``nn.Embedding`` split along the vocabulary), ``"replicated_with_grad_allreduce"`` (a replicated
module on local shards, its gradients summed over the ranks), or a ``ParallelStyle`` object. It comes from
``Scenario.tp_plan``, else the model's ``tp_plan`` attribute (a Hugging Face model's own plan, its
``base_model_tp_plan`` with the head's, applied with torch's styles above, not transformers').

Every rank sees the whole batch (unlike DDP/FSDP's ``ranks.shard_batch``). Parameters in the plan
become DTensors (record/capture.py records their shards with their layout); the activations the
style hands over as local tensors (a colwise output and its gradient, a rowwise input and its
gradient where the hooks see a local tensor) get the same meta ``layout`` from the style here
(``activation_layouts``); everything else is replicated.
"""
from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from driftcheck.errors import DriftcheckError

# Hugging Face's names (ALL_PARALLEL_STYLES) for torch's own styles; colwise_gather_output is
# colwise_rep's other name there
STYLE_NAMES = ("colwise", "rowwise", "colwise_rep", "colwise_gather_output", "embedding_rowwise",
               "replicated_with_grad_allreduce")

# model -> ({module path: style}, (tensor-parallel ranks, this rank's coordinate), (data-parallel
# groups, this rank's group) or None): what parallelize applied
_APPLIED: weakref.WeakKeyDictionary[
    nn.Module, tuple[dict[str, Any], tuple[int, int], tuple[int, int] | None]] = weakref.WeakKeyDictionary()

_DESCRIBED: weakref.WeakKeyDictionary[nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()

Layout = Callable[[str, str, torch.Tensor], "dict[str, Any] | None"]


def plan_of(model: nn.Module, plan: dict[str, Any] | None, model_id: str | None) -> dict[str, Any]:
    """The tensor-parallel plan of ``model``: ``plan`` (the scenario's), else ``model.tp_plan``.

    Raises:
        DriftcheckError: one line: the model has no plan."""
    found = plan if plan else getattr(model, "tp_plan", None)
    if not found or not isinstance(found, dict):
        raise DriftcheckError(
            f"model {model_id or type(model).__name__} has no tensor-parallel plan: --parallel tp "
            "needs Scenario(tp_plan={'module.path': 'colwise'|'rowwise', ...}) or a tp_plan "
            "attribute on the model; use --parallel ddp|fsdp, or record a single process")
    return dict(found)


def resolve(model: nn.Module, plan: dict[str, Any], world: int
            ) -> tuple[dict[str, Any], dict[str, str]]:
    """``plan`` with its patterns matched against the model's module paths: ({path:
    ParallelStyle}, {path: the parameter it is tied to} of the modules left replicated because a
    parameter of theirs is tied to another module's: torch's styles would replace it by a
    DTensor in one of them and cut the tie, as of an lm_head sharing the embedding).

    Raises:
        DriftcheckError: a pattern matching no module, an unknown style, a style on a module
            that is not an ``nn.Linear``, or features the world size does not divide."""
    names = dict(model.named_modules())
    out: dict[str, Any] = {}
    for pattern, style in plan.items():
        hits = [n for n in names if n and _matches(n, pattern)]
        if not hits:
            raise DriftcheckError(f"tp_plan: {pattern!r} matches no module of the model "
                                  f"(its modules: {', '.join(list(names)[1:6])}, ...)")
        for n in hits:
            out[n] = _style(style, pattern)
            _check_divisible(n, names[n], out[n], world)
    tied = _tied(model, out)
    return {n: st for n, st in out.items() if n not in tied}, tied


def _tied(model: nn.Module, styles: dict[str, Any]) -> dict[str, str]:
    """{module path: the other owner of a parameter of its own} of the modules in ``styles``."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    out = {}
    for name in styles:
        for pname, p in model.get_submodule(name).named_parameters(recurse=False):
            others = [o for o in owners.get(id(p), []) if o != f"{name}.{pname}"]
            if others:
                out[name] = others[0]
    return out


def _matches(path: str, pattern: str) -> bool:
    parts, pats = path.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats))


def _style(style: Any, pattern: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    if isinstance(style, ParallelStyle):
        return style
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style in ("colwise_rep", "colwise_gather_output"):  # the output gathered on every rank
        return ColwiseParallel(output_layouts=Replicate())
    if style == "embedding_rowwise":  # an Embedding split along its rows (the vocabulary)
        return RowwiseParallel(input_layouts=Replicate())
    if style == "replicated_with_grad_allreduce":
        return _grad_all_reduce()
    raise DriftcheckError(f"tp_plan: {pattern!r}: style {style!r} is not one of "
                          f"{', '.join(STYLE_NAMES)} (or a ParallelStyle object)")


def _grad_all_reduce() -> Any:
    """Hugging Face's ``replicated_with_grad_allreduce`` as a torch style: a replicated module on
    a sharded activation (Qwen3's per-head q/k norms see this rank's heads only) whose parameter
    gradients are summed over the ranks as they are accumulated (before driftcheck's own
    gradient hook, registered later, reads them)."""
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import ParallelStyle

    class GradAllReduce(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            group = device_mesh.get_group()
            for p in module.parameters(recurse=False):
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(
                        lambda q: dist.all_reduce(q.grad, group=group) if q.grad is not None else None)
            return module

    return GradAllReduce()


def _check_divisible(name: str, module: nn.Module, style: Any, world: int) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return
    if isinstance(module, nn.Embedding) and isinstance(style, RowwiseParallel):
        feats, what = module.num_embeddings, "embedding"
    elif not isinstance(module, nn.Linear):
        raise DriftcheckError(f"tp_plan: {name} is a {type(module).__name__}; the colwise and "
                              "rowwise styles shard nn.Linear modules (rowwise: nn.Embedding too)")
    elif isinstance(style, ColwiseParallel):
        feats, what = module.out_features, "output"
    else:
        feats, what = module.in_features, "input"
    if feats % world:
        raise DriftcheckError(f"tp_plan: {name} has {feats} {what} features, not a multiple of "
                              f"the {world} ranks; run with a number of ranks that divides it")


def parallelize(model: nn.Module, plan: dict[str, Any], device: torch.device, mesh: Any = None,
                dp_mesh: Any = None) -> nn.Module:
    """Apply ``plan`` (``plan_of``) to ``model`` in place on ``mesh`` (a 1-D device mesh; None:
    one of every rank); ``dp_mesh``: the data-parallel dim of fsdp-tp's 2-D mesh, whose
    coordinate says which part of the batch this rank's activations hold. Returns the model
    (its module paths unchanged)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    if mesh is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    world = mesh.size()
    styles, tied = resolve(model, plan, world)
    if not styles:
        raise DriftcheckError("tp_plan: every module it names shares a parameter with another "
                              f"module ({', '.join(f'{k}: {v}' for k, v in tied.items())}): nothing "
                              "left to shard; untie them")
    parallelize_module(model, mesh, styles)
    _APPLIED[model] = (styles, (world, mesh.get_local_rank()),
                       (dp_mesh.size(), dp_mesh.get_local_rank()) if dp_mesh is not None else None)
    _DESCRIBED[model] = {"plan": {n: _style_name(st) for n, st in styles.items()},
                         **({"replicated_tied": tied} if tied else {}),
                         **({"mesh": {"dp": dp_mesh.size(), "tp": world}} if dp_mesh is not None else {})}
    return model


def described(model: nn.Module) -> dict[str, Any] | None:
    """The run metadata ``tensor_parallel`` of a model ``parallelize`` sharded: ``plan`` (module
    path: the style's class), ``replicated_tied`` (the modules left out: the tied parameter),
    under fsdp-tp ``mesh`` ({"dp": data-parallel groups, "tp": ranks in each})."""
    return _DESCRIBED.get(model)


def _style_name(style: Any) -> str:
    sides = sharded_sides(style)
    return type(style).__name__ + (f"(local {', '.join(sides)})" if sides else "")


def activation_layouts(model: nn.Module) -> dict[str, Layout]:
    """{module path: layout(phase, slot, tensor)} for the modules ``parallelize`` gave a style
    that hands over a local shard: the meta ``layout`` of a plain tensor there that is this
    rank's part of the last dim (None: replicated). {} for a model not parallelized."""
    applied = _APPLIED.get(model)
    if applied is None:
        return {}
    styles, tp, dp = applied
    out: dict[str, Layout] = {}
    for name, style in styles.items():
        sides = sharded_sides(style)
        if sides:
            out[name] = _layout_fn(sides, tp, dp)
    return out


def sharded_sides(style: Any) -> tuple[str, ...]:
    """Which of a style's module inputs and outputs are local shards along the last dim:
    ("input",), ("output",), both or neither (read off the style's layouts)."""
    from torch.distributed.tensor import Shard

    def last_dim_shard(layouts: Any) -> bool:
        first = layouts[0] if isinstance(layouts, (tuple, list)) and layouts else layouts
        return isinstance(first, Shard) and first.dim == -1

    sides = []
    if last_dim_shard(getattr(style, "input_layouts", None)):
        sides.append("input")
    if getattr(style, "use_local_output", False) and last_dim_shard(getattr(style, "output_layouts", None)):
        sides.append("output")
    return tuple(sides)


def _layout_fn(sides: tuple[str, ...], tp: tuple[int, int], dp: tuple[int, int] | None) -> Layout:
    """The layout of a style's local shard along the last dim on the tensor-parallel mesh
    (``tp``: its size, this rank's coordinate); under fsdp-tp (``dp``: the data-parallel groups,
    this rank's) also this group's part of the batch along dim 0: a block of a (dp, tp) mesh."""
    prefixes = tuple(sides) + tuple("grad_" + s for s in sides)
    (world, rank) = tp

    def layout(phase: str, slot: str, t: torch.Tensor) -> dict[str, Any] | None:
        if phase not in ("forward", "backward") or t.dim() == 0 or not slot.startswith(prefixes):
            return None
        d = t.dim() - 1
        if dp is None:
            return {"placements": [f"S{d}"], "mesh": [world], "coord": [rank],
                    "global_shape": [*t.shape[:-1], t.shape[-1] * world]}
        if d == 0:  # no batch dim besides the sharded one: not a block of the 2-D mesh
            return None
        groups, group = dp
        shape = [t.shape[0] * groups, *t.shape[1:-1], t.shape[-1] * world]
        offset = [group * t.shape[0], *([0] * (d - 1)), rank * t.shape[-1]]
        return {"placements": ["S0", f"S{d}"], "mesh": [groups, world], "coord": [group, rank],
                "global_shape": shape, "offset": offset, "batch": True}
    return layout
