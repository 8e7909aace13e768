"""Which modules, phases and steps a record captures, and in which form (full tensors or
statistics): the CaptureConfig's globs turned into the predicates the hooks ask."""
from __future__ import annotations

import fnmatch

from driftcheck.record.config import CaptureConfig

_SELECTED_BY = {"params": "forward", "loss": "forward"}  # phases --phases does not name


class Selection:
    """``module(path)``, ``phase(phase, step)`` and ``full(path)`` for one CaptureConfig."""

    def __init__(self, config: CaptureConfig) -> None:
        self.mode = config.mode
        self.include = list(config.include)
        self.exclude = list(config.exclude)
        self.full_modules = list(config.full_modules)
        self.phases = set(config.selected_phases)
        self.steps = None if config.steps is None else set(config.steps)
        self._cache: dict[str, bool] = {}

    def module(self, name: str) -> bool:
        """Whether the module at path ``name`` is captured (include, then exclude)."""
        hit = self._cache.get(name)
        if hit is None:
            hit = (not self.include or any(fnmatch.fnmatchcase(name, g) for g in self.include)) \
                and not any(fnmatch.fnmatchcase(name, g) for g in self.exclude)
            self._cache[name] = hit
        return hit

    def phase(self, phase: str, step: int) -> bool:
        """Whether ``phase`` of step ``step`` is captured (params with forward or optimizer,
        the loss with forward)."""
        if self.steps is not None and step not in self.steps:
            return False
        if phase == "params":
            return bool(self.phases & {"forward", "optimizer"})
        return _SELECTED_BY.get(phase, phase) in self.phases

    def full(self, name: str) -> bool:
        """Whether the module's tensors are kept whole (else summarised with a sample)."""
        if self.mode == "full":
            return True
        if self.mode == "auto":
            return any(fnmatch.fnmatchcase(name, g) for g in self.full_modules)
        return False
