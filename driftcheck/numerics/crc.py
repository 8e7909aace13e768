"""CRC32C of an array by parts: each part's checksum taken on its own (on any thread), the
whole one combined from them exactly, as zlib's ``crc32_combine`` does for CRC-32.

``combine(crc(A), crc(B), len(B)) == crc(A + B)``: the checksum of A shifted over len(B) zero
bytes (a multiplication by x^(8 len(B)) modulo the polynomial, in GF(2)) xor B's. Pure
arithmetic on 32-bit integers; the shift operator of each length is computed once.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import crc32c as _crc32c

POLY = 0x82F63B78  # CRC32C (Castagnoli), reflected


def checksum(data: Any, value: int = 0) -> int:
    """CRC32C of a buffer (``crc32c.crc32c``: hardware-assisted, the GIL released)."""
    return _crc32c.crc32c(data, value)


def _multiply(a: int, b: int) -> int:
    """a * b modulo the polynomial, both reflected (bit 31 is x^0)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1


def _powers() -> list[int]:
    """x^(2^k) modulo the polynomial, k = 0..63. (zlib wraps k at 32 for CRC-32, whose
    x^(2^32) is x; CRC32C's is not, so the table runs to any length a buffer can have.)"""
    out = [1 << 30]  # x^1
    for _ in range(63):
        out.append(_multiply(out[-1], out[-1]))
    return out


_X2N = _powers()


@functools.lru_cache(maxsize=256)
def _shift(nbytes: int) -> int:
    """x^(8 nbytes) modulo the polynomial."""
    p, k, n = 1 << 31, 3, nbytes  # x^0; 2^3 = 8 bits a byte
    while n:
        if n & 1:
            p = _multiply(_X2N[k], p)
        n >>= 1
        k += 1
    return p


def combine(first: int, second: int, second_bytes: int) -> int:
    """The CRC32C of two buffers laid end to end, from theirs and the second one's length."""
    return _multiply(_shift(second_bytes), first) ^ second if second_bytes else first


def combine_all(parts: Iterable[tuple[int, int]]) -> int:
    """The CRC32C of buffers laid end to end in order, from (checksum, length) of each."""
    value = 0
    for crc, nbytes in parts:
        value = combine(value, crc, nbytes)
    return value
