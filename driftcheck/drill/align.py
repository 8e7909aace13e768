"""Aligning the ops of two runs of one module call (pure: tokens in, index pairs out).

Two backends issue different op sequences for the same code: a cast inserted by autocast, a
fused op on one side that the other decomposes, a different attention kernel. Ops are matched
by (phase, op name without overload, output shapes) as the longest common subsequence
(``difflib``, no junk heuristic); an op without a counterpart is left unmatched, and the
sequences after it still align.
"""
from __future__ import annotations

import difflib
from collections.abc import Sequence


def align(ref_tokens: Sequence[str], tgt_tokens: Sequence[str]) -> list[tuple[int, int]]:
    """(reference index, target index) pairs of matched ops, in order."""
    sm = difflib.SequenceMatcher(None, list(ref_tokens), list(tgt_tokens), autojunk=False)
    pairs: list[tuple[int, int]] = []
    for a, b, n in sm.get_matching_blocks():
        pairs.extend((a + k, b + k) for k in range(n))
    return pairs


def unmatched(n: int, matched: set[int]) -> list[tuple[int, int]]:
    """The runs [start, end) of indices below ``n`` that are not in ``matched``."""
    gaps: list[tuple[int, int]] = []
    start = None
    for i in range(n):
        if i in matched:
            if start is not None:
                gaps.append((start, i))
                start = None
        elif start is None:
            start = i
    if start is not None:
        gaps.append((start, n))
    return gaps
