"""numerics/crc.py: the CRC32C of buffers laid end to end, combined from each one's checksum and
length, is the checksum of the whole, for any lengths (the chunks of a full-mode copy)."""
from __future__ import annotations

import crc32c
from hypothesis import given, settings, strategies as st

from driftcheck.numerics import crc


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=2000), max_size=6))
def test_combined_checksums_are_the_whole_ones(parts: list[bytes]) -> None:
    whole = b"".join(parts)
    assert crc.combine_all((crc32c.crc32c(p), len(p)) for p in parts) == crc32c.crc32c(whole)


def test_long_parts_and_empty_ones() -> None:
    a, b = bytes(range(256)) * 40_000, b"\x01" * (3 << 20)  # lengths far beyond one table entry
    assert crc.combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)
    assert crc.combine(crc32c.crc32c(a), crc32c.crc32c(b""), 0) == crc32c.crc32c(a)
    assert crc.combine(0, crc32c.crc32c(b), len(b)) == crc32c.crc32c(b)
    assert crc.checksum(a) == crc32c.crc32c(a) and crc.checksum(b, 7) == crc32c.crc32c(b, 7)
