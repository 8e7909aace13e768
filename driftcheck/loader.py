"""MODEL specs -> Scenario: a built-in name, ``hf:<family>``/``hf:PATH``, ``file.py:build``,
``package.module:build``. User code runs here (it is the user's own model); trace files never
load code."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from driftcheck.errors import DriftcheckError
from driftcheck.scenario import Scenario


def load_scenario(spec: str, seed: int = 0) -> Scenario:
    """Build the Scenario named by ``spec`` (see module docstring)."""
    from driftcheck import models

    if not isinstance(spec, str) or not spec.strip():
        raise DriftcheckError("MODEL is empty: pass a built-in name (driftcheck models), "
                              "hf:<family>, path/to/file.py:build or package.module:build")
    spec = spec.strip()
    if spec in models.BUILTINS:
        sc = models.load(spec, seed)
    elif spec.startswith("hf:"):
        from driftcheck import hf

        sc = hf.resolve(spec[3:], seed)
    elif ":" in spec:
        sc = _load_callable(spec, seed)
    else:
        raise DriftcheckError(
            f"unknown model {spec!r}: choose one of {', '.join(sorted(models.BUILTINS))} "
            "(driftcheck models), or pass hf:<family>, path/to/file.py:build or package.module:build")
    return _check(sc, spec)


def _load_callable(spec: str, seed: int) -> Scenario:
    where, _, fn_name = spec.rpartition(":")
    if not fn_name.isidentifier():
        raise DriftcheckError(f"model spec {spec!r}: {fn_name!r} is not a function name "
                              "(expected path/to/file.py:build or package.module:build)")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise DriftcheckError(f"model file {where} does not exist")
        mod_name = f"driftcheck_user_{abs(hash(str(path.resolve())))}"
        try:
            ms = importlib.util.spec_from_file_location(mod_name, path)
            if ms is None or ms.loader is None:
                raise DriftcheckError(f"model file {where} cannot be imported as Python")
            module = importlib.util.module_from_spec(ms)
            sys.modules[mod_name] = module
            ms.loader.exec_module(module)
        except DriftcheckError:
            raise
        except Exception as e:
            raise DriftcheckError(f"model file {where} raised {type(e).__name__} on import: {e}") from e
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise DriftcheckError(f"cannot import module {where!r} ({e}); is it on PYTHONPATH?") from e
        except Exception as e:
            raise DriftcheckError(f"module {where!r} raised {type(e).__name__} on import: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise DriftcheckError(f"{where} has no function {fn_name!r}")
    try:
        try:
            sc = fn(seed=seed)
        except TypeError as e:
            if "seed" not in str(e):
                raise
            sc = fn()
    except DriftcheckError:
        raise
    except Exception as e:
        raise DriftcheckError(f"{spec} raised {type(e).__name__}: {e}") from e
    if isinstance(sc, Scenario) and not sc.name:
        sc.name = spec
    return sc


def _check(sc: object, spec: str) -> Scenario:
    import torch

    if not isinstance(sc, Scenario):
        raise DriftcheckError(f"{spec} returned {type(sc).__name__}, expected driftcheck.Scenario"
                              "(model=..., inputs=..., loss=..., optimizer=...)")
    if not isinstance(sc.model, torch.nn.Module):
        raise DriftcheckError(f"{spec}: Scenario.model is {type(sc.model).__name__}, expected a "
                              "torch.nn.Module")
    if not isinstance(sc.steps, int) or isinstance(sc.steps, bool) or sc.steps < 1:
        raise DriftcheckError(f"{spec}: Scenario.steps must be a positive integer, got {sc.steps!r}")
    if isinstance(sc.inputs, list) and not sc.inputs:
        raise DriftcheckError(f"{spec}: Scenario.inputs is an empty list of batches")
    if sc.loss is not None and not callable(sc.loss):
        raise DriftcheckError(f"{spec}: Scenario.loss must be callable(output, batch)")
    if sc.optimizer is not None and not callable(sc.optimizer):
        raise DriftcheckError(f"{spec}: Scenario.optimizer must be callable(params) -> Optimizer")
    if not sc.name:
        sc.name = spec
    return sc
