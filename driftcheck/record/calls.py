"""The module calls of the step being traced: each call's number, the stack of calls open now,
and whether a hook is to take what it sees (attached, not paused between a loop's steps, not
inside a local replay of a module)."""
from __future__ import annotations

CallKey = tuple[str, int]  # (module path, the call's number within the step)


class Calls:
    """The open module calls and their numbers; reset at each step (``reset``)."""

    def __init__(self) -> None:
        self.active = False  # attached: hooks capture (detach() turns it off first)
        self.paused = False  # pause(): between a loop's steps (evaluation, logging) nothing is a call
        self.replaying = False  # a local replay runs: the module's hooks see no call of the run
        self.counts: dict[str, int] = {}
        self.stack: list[CallKey] = []

    def reset(self) -> None:
        self.counts = {}
        self.stack = []

    @property
    def ignored(self) -> bool:
        """Whether a module hook firing now is no call of the traced run."""
        return self.replaying or self.paused

    @property
    def top(self) -> CallKey | None:
        """The innermost call open now, or None outside any module."""
        return self.stack[-1] if self.stack else None

    @property
    def current_module(self) -> str:
        """The module path running now; "" outside any module."""
        return self.stack[-1][0] if self.stack else ""

    def open(self, name: str) -> tuple[int, CallKey | None]:
        """A call of ``name`` begins: (its number, the enclosing call or None)."""
        call = self.counts.get(name, 0)
        self.counts[name] = call + 1
        parent = self.stack[-1] if self.stack else None
        self.stack.append((name, call))
        return call, parent

    def close(self, name: str) -> CallKey:
        """The innermost call ends: its key (``(name, 0)`` where none is open)."""
        return self.stack.pop() if self.stack else (name, 0)

    def count(self, name: str) -> int:
        """How many calls of ``name`` this step has begun."""
        return self.counts.get(name, 0)


def call_label(key: CallKey | None) -> str | None:
    """``("layers.0", 1)`` -> ``"layers.0#1"``: a call as the trace's meta names it."""
    return f"{key[0]}#{key[1]}" if key else None
