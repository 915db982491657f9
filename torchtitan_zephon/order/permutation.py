"""Keyed per-epoch permutations of sample indices.

Role: map a position inside an epoch to a sample index without materialising an
O(N) index, so that resuming at any position costs O(1).

Invariant: for every (n, seed, epoch), ``Permutation(n, seed, epoch)`` is a
bijection on ``[0, n)``; ``map``, ``__getitem__`` and ``map_many`` (several
permutations evaluated together, for a mixture's sources) agree element for
element, and the result depends only on (n, seed, epoch), never on the platform
or on how the positions are batched. ``inverse`` is its inverse:
``inverse(map(p)) == p`` and ``map(inverse(i)) == i`` for every p and i in
``[0, n)``, so "at which position of the epoch does sample i come?" costs the
same O(1) as the forward question, with no scan.

Mechanics: an alternating (possibly unbalanced) Feistel network over the
smallest power of two >= n, with cycle walking to stay inside ``[0, n)``.
Round keys are derived from (n, seed, epoch) with blake2b. The inverse runs the
rounds backwards (each round is undone by recomputing F from the half it kept)
and walks the cycle backwards: the forward walk passes only through values
>= n, so decrypting until the value is < n lands on the position it started from.
"""

from __future__ import annotations

import hashlib

import numpy as np

_ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic); ``z`` is consumed."""
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


_MASK64 = (1 << 64) - 1
_M1_INT, _M2_INT = int(_M1), int(_M2)
# Below this many positions, plain Python integers beat numpy's per-call overhead
# (a micro-batch of 8 ids: ~20 us instead of ~140 us). Both paths give identical values.
_SCALAR_MAX = 48


def _mix_int(z: int) -> int:
    """``_mix`` on one Python int."""
    z ^= z >> 30
    z = (z * _M1_INT) & _MASK64
    z ^= z >> 27
    z = (z * _M2_INT) & _MASK64
    return z ^ (z >> 31)


class Permutation:
    """A bijection on ``[0, n)`` keyed by (seed, epoch), with O(1) random access."""

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        if int(n) < 1:
            raise ValueError(f"Permutation needs n >= 1 samples, got n={n}.")
        if int(n) > 2**62:
            raise ValueError(f"Permutation supports n <= 2**62, got n={n}.")
        self.n = int(n)
        self.seed = int(seed)
        self.epoch = int(epoch)
        self._bits = max(2, (self.n - 1).bit_length())
        digest = hashlib.blake2b(
            f"zephon-permutation-v1:{self.n}:{self.seed}:{self.epoch}".encode(),
            digest_size=8 * _ROUNDS,
        ).digest()
        # Per round: (key, right shift, right mask, left shift, left mask). The halves
        # alternate sizes so an odd bit count still gives a bijection on 2**bits.
        self._int_rounds: list[tuple[int, int, int, int, int]] = []
        right_bits = self._bits // 2
        for r in range(_ROUNDS):
            left_bits = self._bits - right_bits
            key = int.from_bytes(digest[8 * r : 8 * r + 8], "little")
            self._int_rounds.append(
                (key, right_bits, (1 << right_bits) - 1, left_bits, (1 << left_bits) - 1)
            )
            right_bits = left_bits
        self._np_rounds: list[tuple[np.uint64, ...]] | None = None  # built on first use

    @property
    def _rounds(self) -> list[tuple[np.uint64, ...]]:
        """The rounds as numpy scalars (the vectorized path); built once, on first use."""
        if self._np_rounds is None:
            self._np_rounds = [tuple(np.uint64(v) for v in r) for r in self._int_rounds]
        return self._np_rounds

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        return f"Permutation(n={self.n}, seed={self.seed}, epoch={self.epoch})"

    def __getitem__(self, i: int) -> int:
        i = int(i)
        if not 0 <= i < self.n:
            raise IndexError(f"Permutation index {i} outside [0, {self.n}).")
        return int(self.map(np.array([i], dtype=np.uint64))[0])

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        """One pass of the Feistel network over [0, 2**bits)."""
        for key, right_shift, right_mask, left_shift, left_mask in self._rounds:
            right = x & right_mask
            f = _mix(right ^ key)
            f &= left_mask
            f ^= x >> right_shift  # left half xor F(right)
            right <<= left_shift
            x = right | f
        return x

    def _encrypt_int(self, x: int) -> int:
        """``_encrypt`` on one Python int."""
        for key, right_shift, right_mask, left_shift, left_mask in self._int_rounds:
            right = x & right_mask
            x = (right << left_shift) | ((_mix_int(right ^ key) & left_mask) ^ (x >> right_shift))
        return x

    def _map_scalar(self, p: np.ndarray) -> np.ndarray:
        n, out = self.n, []
        for x in p.ravel().tolist():
            y = self._encrypt_int(x)
            while y >= n:  # cycle walking
                y = self._encrypt_int(y)
            out.append(y)
        return np.array(out, dtype=np.int64).reshape(p.shape)

    def map(self, positions: np.ndarray) -> np.ndarray:
        """Vectorised ``self[p]`` for every p in ``positions`` (any integer dtype).

        Returns an int64 array of the same shape.
        """
        p = np.asarray(positions)
        if p.size and (p.min() < 0 or p.max() >= self.n):
            raise IndexError(
                f"Permutation positions must lie in [0, {self.n}), "
                f"found values in [{p.min()}, {p.max()}]."
            )
        if self.n == 1:
            return np.zeros(p.shape, dtype=np.int64)
        if p.size <= _SCALAR_MAX:
            return self._map_scalar(p)
        y = self._encrypt(p.astype(np.uint64).ravel())
        out = np.nonzero(y >= np.uint64(self.n))[0]
        while out.size:  # cycle walking: re-encrypt values that left [0, n)
            y[out] = self._encrypt(y[out])
            out = out[y[out] >= np.uint64(self.n)]
        return y.astype(np.int64).reshape(p.shape)

    def _decrypt(self, y: np.ndarray) -> np.ndarray:
        """``_encrypt`` undone: the rounds in reverse order, each one inverted."""
        for key, right_shift, _, left_shift, left_mask in reversed(self._rounds):
            right = y >> left_shift  # the half the round kept, moved up
            left = y & left_mask
            f = _mix(right ^ key)
            f &= left_mask
            left ^= f
            left <<= right_shift
            y = left | right
        return y

    def _decrypt_int(self, y: int) -> int:
        """``_decrypt`` on one Python int."""
        for key, right_shift, _, left_shift, left_mask in reversed(self._int_rounds):
            right = y >> left_shift
            y = (((y & left_mask) ^ (_mix_int(right ^ key) & left_mask)) << right_shift) | right
        return y

    def inverse(self, ids: np.ndarray) -> np.ndarray:
        """The position of each sample index in ``ids`` (any integer dtype): the p with
        ``self[p] == i``. Returns an int64 array of the same shape."""
        q = np.asarray(ids)
        if q.size and (q.min() < 0 or q.max() >= self.n):
            raise IndexError(
                f"Permutation sample indices must lie in [0, {self.n}), "
                f"found values in [{q.min()}, {q.max()}]."
            )
        if self.n == 1:
            return np.zeros(q.shape, dtype=np.int64)
        n = self.n
        if q.size <= _SCALAR_MAX:
            out = []
            for y in q.ravel().tolist():
                x = self._decrypt_int(y)
                while x >= n:  # the cycle walked backwards
                    x = self._decrypt_int(x)
                out.append(x)
            return np.array(out, dtype=np.int64).reshape(q.shape)
        x = self._decrypt(q.astype(np.uint64).ravel())
        out = np.nonzero(x >= np.uint64(n))[0]
        while out.size:
            x[out] = self._decrypt(x[out])
            out = out[x[out] >= np.uint64(n)]
        return x.astype(np.int64).reshape(q.shape)


def map_many(perms: list[Permutation], which: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``perms[which[k]][positions[k]]`` for every k (int64): one vectorized Feistel pass
    over all elements, each with its own permutation's round keys, sizes and domain.

    Equal to calling each permutation's ``map`` on its elements; far cheaper when
    many permutations (a mixture's sources) each map a few positions.
    """
    w = np.asarray(which, dtype=np.int64).ravel()
    p = np.asarray(positions, dtype=np.int64).ravel()
    n = np.array([q.n for q in perms], dtype=np.int64)[w]
    if p.size and ((p < 0).any() or (p >= n).any()):
        bad = int(np.nonzero((p < 0) | (p >= n))[0][0])
        raise IndexError(
            f"Permutation position {int(p[bad])} outside [0, {int(n[bad])}) (element {bad})."
        )
    if len(perms) == 1:
        return perms[0].map(p)
    if p.size <= _SCALAR_MAX:
        return np.array(
            [
                perms[k].map(np.array([x], dtype=np.uint64))[0]
                for k, x in zip(w.tolist(), p.tolist(), strict=True)
            ],
            dtype=np.int64,
        )
    # Round keys per element as rows ([rounds, elements], contiguous); shifts and masks
    # depend only on the domain's bits, so elements are encrypted in groups of equal bits
    # (usually one) with those as scalars: the per-element work is the keys alone.
    keys = np.array([[r[0] for r in q._int_rounds] for q in perms], dtype=np.uint64).T
    bits = np.array([q._bits for q in perms], dtype=np.int64)
    groups = np.unique(bits).tolist()
    y = np.empty(p.size, dtype=np.uint64)
    for b in groups:
        sel = slice(None) if len(groups) == 1 else np.flatnonzero(bits[w] == b)
        rounds = perms[bits.tolist().index(b)]._rounds
        x, kw, limit = p[sel].astype(np.uint64), keys[:, w[sel]], n[sel].astype(np.uint64)
        x = _encrypt_keyed(x, kw, rounds)
        walk = np.flatnonzero(x >= limit)  # cycle walking: re-encrypt values outside [0, n)
        kw, limit = kw[:, walk], limit[walk]
        while walk.size:
            v = x[walk] = _encrypt_keyed(x[walk], kw, rounds)
            keep = v >= limit
            walk, kw, limit = walk[keep], kw[:, keep], limit[keep]
        y[sel] = x
    single = n == 1
    if single.any():
        y[single] = 0
    return y.astype(np.int64)


def _encrypt_keyed(
    x: np.ndarray, keys: np.ndarray, rounds: list[tuple[np.uint64, ...]]
) -> np.ndarray:
    """``Permutation._encrypt`` with a round key per element (``keys[r]``: round r's)."""
    for r, (_, right_shift, right_mask, left_shift, left_mask) in enumerate(rounds):
        right = x & right_mask
        f = _mix(right ^ keys[r])
        f &= left_mask
        f ^= x >> right_shift
        right <<= left_shift
        right |= f
        x = right
    return x
