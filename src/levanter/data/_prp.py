"""Stateless pseudo-random permutations of ``[0, n)`` and seed derivation.

A :class:`FeistelPermutation` is a keyed bijection on ``[0, n)`` evaluated pointwise: no table is
built, so permuting a dataset of 10**12 rows costs the same per lookup as one of 10 rows, and any
index can be mapped without replaying history (resume is a pure function of the step).

Construction: a balanced Feistel network on the smallest even bit width ``2h >= log2(n)``, with a
splitmix64-style round function, plus *cycle walking* (re-encrypt until the value falls below
``n``), which keeps it a bijection on ``[0, n)``. Expected walks per value are < 4 because
``2**(2h) < 4n``. Large requests are vectorised over numpy ``uint64`` arrays (wrap-around
arithmetic); a request of a few indices -- what a mixture asks of each source per step -- is mapped
with plain Python ints instead, because a Feistel pass is some 60 numpy calls whose fixed cost
dominates for small arrays (docs/bench/2026-12-03-cpu-levers.md; the two paths break even near 48 indices, so
the int path takes up to 32). Both paths compute the same function; the tests compare them exhaustively on
small domains.

Seeds are derived, never drawn: :func:`derive_seed` hashes a parent seed and a path of ints
(stage, block, ...) with BLAKE2b, so sub-permutations are independent of evaluation order.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable

import numpy as np

__all__ = ["derive_seed", "seed_from_key", "FeistelPermutation", "permute_many"]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_U64 = 0xFFFFFFFFFFFFFFFF
# A cycle walk repeats until every value of the array is inside the range, so one unlucky value costs a
# whole numpy pass (~70 calls); the last few values finish their walks with Python ints instead.
_WALK_TAIL = 6


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a fast, well-mixing bijection on uint64 (arrays only: wraps silently)."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


def derive_seed(seed: int, *path: int) -> int:
    """A 64-bit seed for the sub-stream ``path`` of ``seed`` (e.g. ``derive_seed(s, stage, block)``)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", seed & 0xFFFFFFFFFFFFFFFF))
    for p in path:
        if p < 0:
            raise ValueError(f"derive_seed path elements must be non-negative, got {p}")
        h.update(struct.pack("<Q", p & 0xFFFFFFFFFFFFFFFF))
        h.update(struct.pack("<Q", p >> 64))
    return int.from_bytes(h.digest(), "little")


def seed_from_key(key) -> int:
    """A 64-bit int seed from an int or a JAX PRNG key (raw ``uint32[2]`` or typed key).

    ``None`` is refused: shuffles and mixtures never run unseeded.
    """
    if key is None:
        raise ValueError("a seed is required (got None): pass `key=` (an int or a jax PRNG key)")
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return int(key) & 0xFFFFFFFFFFFFFFFF
    try:  # typed jax keys
        import jax

        if jax.dtypes.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key):
            key = jax.random.key_data(key)
    except (ImportError, TypeError):
        pass
    arr = np.asarray(key)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"cannot derive a seed from {key!r}: expected an int or a jax PRNG key")
    return derive_seed(0, *[int(v) & 0xFFFFFFFF for v in arr.ravel()])


class FeistelPermutation:
    """A keyed bijection on ``[0, n)``; ``perm(indices)`` maps a numpy int array (or int) pointwise."""

    ROUNDS = 6
    # Requests of at most this many indices take the Python-int path (see the module docstring).
    SMALL = 32

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError(f"permutation length must be >= 1, got {n}")
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        self._half = (bits + 1) // 2
        self._shift = np.uint64(self._half)
        self._mask = np.uint64((1 << self._half) - 1)
        self._int_keys = [derive_seed(seed, r) for r in range(self.ROUNDS)]
        self._round_keys = [np.uint64(k) for k in self._int_keys]

    def _walk_int(self, v: int) -> int:
        """Continue a cycle walk from ``v`` (an encryption outside ``[0, n)``): the next value inside."""
        return self._permute_int(v)

    def _permute_int(self, v: int) -> int:
        """The permutation of one index with Python ints (``& _U64`` stands in for uint64 wrap-around)."""
        h, mask, n, keys = self._half, (1 << self._half) - 1, self.n, self._int_keys
        while True:
            left, right = v >> h, v & mask
            for k in keys:
                x = right ^ k
                x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
                x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
                left, right = right, left ^ ((x ^ (x >> 31)) & mask)
            v = (left << h) | right
            if v < n:
                return v

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left = x >> self._shift
        right = x & self._mask
        for k in self._round_keys:
            left, right = right, left ^ (_mix64(right ^ k) & self._mask)
        return (left << self._shift) | right

    def __call__(self, indices):
        scalar = np.ndim(indices) == 0
        x = np.atleast_1d(np.asarray(indices, dtype=np.int64))
        if x.size and (x.min() < 0 or x.max() >= self.n):
            bad = x[(x < 0) | (x >= self.n)][0]
            raise IndexError(f"index {int(bad)} out of range for a permutation of length {self.n}")
        if self.n == 1:
            return 0 if scalar else x.copy()
        if x.size <= self.SMALL:
            y = np.fromiter(map(self._permute_int, x.tolist()), dtype=np.int64, count=x.size)
            return int(y[0]) if scalar else y
        y = self._encrypt(x.astype(np.uint64))
        n = np.uint64(self.n)
        todo = np.flatnonzero(y >= n)
        while todo.size > _WALK_TAIL:
            y[todo] = self._encrypt(y[todo])
            todo = todo[y[todo] >= n]
        for i in todo.tolist():
            y[i] = self._walk_int(int(y[i]))
        y = y.astype(np.int64)
        return int(y[0]) if scalar else y


def permute_many(requests: "list[tuple[Callable | None, np.ndarray]]") -> list[np.ndarray]:
    """``[perm(idx) for perm, idx in requests]``, the :class:`FeistelPermutation` s among them evaluated
    in one vectorised pass; any other function is applied on its own, and None stands for the identity.

    A mixture permutes a few indices of each of its sources every step; one numpy pass with per-element
    round keys, widths and lengths costs what one source's pass costs (~70 numpy calls per Feistel
    round trip, whatever the array size), instead of one pass per source. Same function, same results.
    """
    if not all(isinstance(p, FeistelPermutation) for p, _ in requests):
        out: list = [None] * len(requests)
        at = [k for k, (p, _) in enumerate(requests) if isinstance(p, FeistelPermutation)]
        for k, (p, idx) in enumerate(requests):
            if not isinstance(p, FeistelPermutation):
                out[k] = np.asarray(idx, dtype=np.int64).reshape(-1) if p is None else p(idx)
        for k, y in zip(at, permute_many([requests[k] for k in at])):
            out[k] = y
        return out
    arrays = [np.asarray(idx, dtype=np.int64).reshape(-1) for _, idx in requests]
    total = sum(a.size for a in arrays)
    if len(requests) < 2 or total <= FeistelPermutation.SMALL:
        return [perm(a) for (perm, _), a in zip(requests, arrays)]
    for (perm, _), a in zip(requests, arrays):
        if a.size and (a.min() < 0 or a.max() >= perm.n):
            bad = a[(a < 0) | (a >= perm.n)][0]
            raise IndexError(f"index {int(bad)} out of range for a permutation of length {perm.n}")
    sizes = [a.size for a in arrays]
    x = np.concatenate(arrays).astype(np.uint64)
    shift = np.repeat(np.array([p._half for p, _ in requests], dtype=np.uint64), sizes)
    mask = np.repeat(np.array([(1 << p._half) - 1 for p, _ in requests], dtype=np.uint64), sizes)
    n = np.repeat(np.array([p.n for p, _ in requests], dtype=np.uint64), sizes)
    keys = np.repeat(np.array([p._int_keys for p, _ in requests], dtype=np.uint64).T, sizes, axis=1)

    def encrypt(v, sh, m, kk):
        left, right = v >> sh, v & m
        for r in range(kk.shape[0]):
            left, right = right, left ^ (_mix64(right ^ kk[r]) & m)
        return (left << sh) | right

    y = encrypt(x, shift, mask, keys)
    todo = np.flatnonzero(y >= n)
    while todo.size > _WALK_TAIL:  # cycle walking, only for the values still outside their range
        y[todo] = encrypt(y[todo], shift[todo], mask[todo], keys[:, todo])
        todo = todo[y[todo] >= n[todo]]
    if todo.size:
        owner = np.repeat(np.arange(len(requests)), sizes)
        for i in todo.tolist():
            y[i] = requests[owner[i]][0]._walk_int(int(y[i]))
    return np.split(y.astype(np.int64), np.cumsum(sizes)[:-1])
