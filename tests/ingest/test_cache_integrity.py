"""Token ids a cache serves stay inside the vocabulary: a damaged cache without checksums (random bytes in
a chunk) is refused where windows are read, naming the cache, on the plain path and on a mixture's planned
(coalesced) reads alike; an intact cache reads unchanged."""

import asyncio

import numpy as np
import pytest

from levanter.data.load_errors import DataLoadError
from levanter.data.loader import DataLoader
from levanter.data.text import CausalLmDataset, TokenSeqDataset
from levanter.store import LEDGER_FILENAME, JaggedArrayStore

VOCAB = 257


def make_cache(tmp_path, tokens):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / LEDGER_FILENAME).write_text("{}")  # marks the directory as the cache to delete
    store = JaggedArrayStore.open(cache / "input_ids", mode="w", data_chunk=64)
    store.append_flat(np.asarray(tokens, dtype=np.int32), np.array([len(tokens)]))
    store.finalize()
    return cache, JaggedArrayStore.open(cache / "input_ids", mode="r", num_rows=1)


def test_ids_outside_the_vocabulary_are_refused_naming_the_cache(tmp_path):
    tokens = np.arange(16 * 40) % VOCAB
    tokens[16 * 21 + 5] = 70_000  # window 21
    cache, store = make_cache(tmp_path, tokens)
    ds = TokenSeqDataset(store, 16, vocab_size=VOCAB)
    got = asyncio.run(ds.get_batch(0, [0, 1, 20]))
    np.testing.assert_array_equal(got, tokens.reshape(-1, 16)[[0, 1, 20]])
    with pytest.raises(ValueError) as info:
        asyncio.run(ds.get_batch(0, [3, 21]))
    assert str(info.value) == (
        f"the cache at {cache} is damaged: it holds token id 70000, outside the vocabulary [0, {VOCAB}) "
        "(a chunk of other bytes); delete it to rebuild"
    )
    # Without a vocabulary nothing is checked (a store of arbitrary ints).
    assert asyncio.run(TokenSeqDataset(store, 16).get_batch(0, [21]))[0, 5] == 70_000


@pytest.mark.parametrize("prefetch", [0, 4])
def test_a_mixture_of_planned_reads_checks_every_window(tmp_path, prefetch):
    from levanter.data.mixture import MixtureDataset

    tokens = np.arange(16 * 200) % VOCAB
    tokens[16 * 150] = -3
    _, store = make_cache(tmp_path, tokens)
    source = CausalLmDataset(TokenSeqDataset(store, 16, vocab_size=VOCAB), eos_id=256, tokens_only=True)
    mixture = MixtureDataset({"a": source}, {"a": 1.0}, batch_schedule=8, key=0,
                             stop_strategy="first_exhausted")
    loader = DataLoader(mixture, 8, prefetch_depth=prefetch)
    seen = []
    with pytest.raises(DataLoadError, match=r"token id -3, outside the vocabulary \[0, 257\)") as info:
        for batch in loader.iter_from_step(0, 25):
            seen.append(np.asarray(batch.data["tokens"]))
    # Window 150 is in step 18 (8 windows a step, in order). A read that coalesces several steps (a group
    # holding step 18) fails as a whole, at the first step served from it: the run stops there, and every
    # step before it came through intact.
    assert info.value.step == len(seen) <= 18
    n = len(seen)
    np.testing.assert_array_equal(np.concatenate(seen), tokens[: n * 8 * 16].reshape(-1, 16))


# -- chunks in the wrong place --------------------------------------------------------------------------------
def _built_cache(tmp_path):
    import json

    from levanter.ingest import ByteTokenizer, CacheOptions, build_or_load_cache

    src = tmp_path / "data.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(200)))
    cache = build_or_load_cache([str(src)], str(tmp_path / "c"), ByteTokenizer(), options=CacheOptions(1, 16),
                                progress=False)
    return src, tmp_path / "c", cache.store.read_rows_sync(range(cache.ledger.total_rows))


def _swap(a, b):
    tmp = a.with_name(a.name + ".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def test_swapped_chunks_pass_their_own_checksum_but_are_refused_at_open(tmp_path):
    from levanter.ingest import ByteTokenizer, CacheOptions, build_or_load_cache
    from levanter.store import DamagedStoreError, TokenCache

    src, cache_dir, rows = _built_cache(tmp_path)
    chunks = cache_dir / "input_ids" / "data" / "c"
    _swap(chunks / "1", chunks / "3")
    wrong = [chunks / "1", chunks / "3"]
    with pytest.raises(DamagedStoreError) as info:
        TokenCache.open(str(cache_dir))
    message = str(info.value)
    assert message.startswith(f"the cache at {cache_dir} is damaged")
    assert all(str(p) in message for p in wrong) and "checksum of another position" in message
    assert message.endswith("delete it to rebuild")
    with pytest.raises(DamagedStoreError, match="another position"):  # the same through a build call
        build_or_load_cache([str(src)], str(cache_dir), ByteTokenizer(), options=CacheOptions(1, 16),
                            progress=False)
    _swap(chunks / "1", chunks / "3")  # put back in place, the cache serves exactly what it held
    reopened = TokenCache.open(str(cache_dir))
    again = reopened.store.read_rows_sync(range(reopened.ledger.total_rows))
    assert len(again) == len(rows) and all(np.array_equal(a, b) for a, b in zip(again, rows))


def test_a_cache_without_a_chunk_record_is_refused_with_how_to_rebuild(tmp_path):
    from levanter.store import DamagedStoreError, TokenCache

    _, cache_dir, _ = _built_cache(tmp_path)
    (cache_dir / "input_ids" / "chunk_checksums.json").unlink()  # as finished by an older version
    with pytest.raises(DamagedStoreError) as info:
        TokenCache.open(str(cache_dir))
    assert str(info.value) == (
        f"the cache at {cache_dir} records no position of its chunk checksums (written by an older version), "
        "so a chunk swapped with another would be read unnoticed; delete it to rebuild"
    )
