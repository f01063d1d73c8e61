"""Feistel permutation: bijective, deterministic, seed-sensitive, for every small length."""

import numpy as np
import pytest

from levanter.data import FeistelPermutation, derive_seed, permute_many, seed_from_key


@pytest.mark.parametrize("n", list(range(1, 70)) + [1000, 4096, 4097])
def test_bijection_on_every_small_length(n):
    perm = FeistelPermutation(n, seed=1234)
    out = perm(np.arange(n))
    assert sorted(out.tolist()) == list(range(n))


def test_deterministic_and_pointwise():
    a = FeistelPermutation(10_000, seed=7)
    b = FeistelPermutation(10_000, seed=7)
    idx = np.array([5, 9999, 0, 5])
    assert a(idx).tolist() == b(idx).tolist()
    assert [a(int(i)) for i in idx] == a(idx).tolist()


def test_seed_changes_the_permutation_and_it_shuffles():
    n = 1000
    a = FeistelPermutation(n, seed=1)(np.arange(n))
    b = FeistelPermutation(n, seed=2)(np.arange(n))
    assert (a != b).mean() > 0.9
    assert (a != np.arange(n)).mean() > 0.9


@pytest.mark.parametrize("n", list(range(2, 300)) + [4097, 2**32 + 5, 10**15 + 3])
def test_small_requests_take_the_int_path_and_agree_with_numpy(n):
    """Requests of <= SMALL indices are mapped with Python ints; they must be the same function."""
    perm = FeistelPermutation(n, seed=99)
    idx = np.arange(min(n, 300), dtype=np.int64) if n <= 300 else np.array([0, 1, n // 3, n - 2, n - 1])
    big = perm(np.concatenate([idx] * (perm.SMALL // max(1, idx.size) + 2)))[: idx.size]  # numpy path
    small = np.concatenate([perm(idx[i : i + perm.SMALL]) for i in range(0, idx.size, perm.SMALL)])
    assert idx.size * (perm.SMALL // max(1, idx.size) + 2) > perm.SMALL
    assert small.tolist() == big.tolist()
    assert [perm(int(i)) for i in idx[:5]] == big[:5].tolist()


def test_huge_domain_pointwise():
    n = 10**15 + 3
    perm = FeistelPermutation(n, seed=3)
    idx = np.array([0, 1, n - 1, 123456789012])
    out = perm(idx)
    assert ((out >= 0) & (out < n)).all()
    assert len(set(out.tolist())) == 4


def test_out_of_range_rejected():
    with pytest.raises(IndexError):
        FeistelPermutation(10, seed=0)(np.array([10]))
    with pytest.raises(ValueError):
        FeistelPermutation(0, seed=0)


def test_seed_derivation():
    assert derive_seed(1, 2, 3) == derive_seed(1, 2, 3)
    assert len({derive_seed(1, 2, 3), derive_seed(1, 3, 2), derive_seed(2, 2, 3), derive_seed(1, 2)}) == 4
    import jax

    assert seed_from_key(jax.random.PRNGKey(0)) == seed_from_key(jax.random.key(0))
    assert seed_from_key(jax.random.PRNGKey(0)) != seed_from_key(jax.random.PRNGKey(1))
    with pytest.raises(ValueError, match="seed is required"):
        seed_from_key(None)


@pytest.mark.parametrize("sizes", [(1, 1), (3, 40, 2), (21, 22, 21), (0, 50, 7), (64,)])
def test_permute_many_is_each_permutation(sizes):
    """One vectorised pass over several permutations (different lengths, widths, keys) equals each."""
    lengths = [1, 2, 5, 70, 1000, 4097, 10**6, 2**32 + 5]
    rng = np.random.default_rng(len(sizes) * 100 + sum(sizes))
    reqs = []
    for i, k in enumerate(sizes):
        n = lengths[(i * 3 + k) % len(lengths)]
        reqs.append((FeistelPermutation(n, seed=i + 7), rng.integers(0, n, k)))
    got = permute_many(reqs)
    for (perm, idx), out in zip(reqs, got):
        assert out.tolist() == [perm(int(i)) for i in idx]
    with pytest.raises(IndexError):
        permute_many([(FeistelPermutation(10, seed=0), np.arange(40)), (FeistelPermutation(10, seed=1), np.array([10]))])
