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


def test_a_second_part_of_512_mib_and_more() -> None:
    """The shift over 2^29 bytes and beyond (the power table does not wrap at 32 for CRC32C,
    as zlib's does for CRC-32, where x^(2^32) is x)."""
    import numpy as np

    first = bytes(range(256))
    for n in ((1 << 29) - 64, 1 << 29, (1 << 29) + 4096):
        zeros = np.zeros(n, dtype=np.uint8)  # untouched zero pages: no memory to speak of
        whole = crc32c.crc32c(zeros, crc32c.crc32c(first))  # first, then the zeros
        assert crc.combine(crc32c.crc32c(first), crc32c.crc32c(zeros), n) == whole, n
