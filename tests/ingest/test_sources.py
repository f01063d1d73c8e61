"""Document readers and URL expansion: every format yields the same documents; bad input names the file."""

import gzip
import os
import json

import numpy as np
import pytest

from levanter.ingest import SourceError, detect_format, expand_braces, expand_urls, iter_documents
from levanter.data.text import causal_lm_columns, causal_lm_columns_jax

DOCS = ["first document", "second, with unicode: héllo ✓", "", "fourth\nspans\nlines"]


def write_jsonl(path, docs, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({key: d, "other": 1}) + "\n")


@pytest.fixture
def shards(tmp_path):
    """The same documents in every supported format."""
    out = {}
    write_jsonl(tmp_path / "a.jsonl", DOCS)
    out["jsonl"] = tmp_path / "a.jsonl"
    with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write((tmp_path / "a.jsonl").read_text(encoding="utf-8"))
    out["gz"] = tmp_path / "a.jsonl.gz"
    import zstandard

    plain = (tmp_path / "a.jsonl").read_bytes()
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(plain))
    out["zst"] = tmp_path / "a.jsonl.zst"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": DOCS}), tmp_path / "a.parquet")
    out["parquet"] = tmp_path / "a.parquet"
    return out


@pytest.mark.parametrize("fmt", ["jsonl", "gz", "zst", "parquet"])
def test_every_format_yields_the_documents_in_order(shards, fmt):
    assert list(iter_documents(str(shards[fmt]))) == DOCS


def test_txt_is_one_document(tmp_path):
    (tmp_path / "book.txt").write_text("line one\nline two\n", encoding="utf-8")
    assert list(iter_documents(str(tmp_path / "book.txt"))) == ["line one\nline two\n"]


def test_custom_text_key_and_blank_lines(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"content": "x"}\n\n{"content": "y"}\n', encoding="utf-8")
    assert list(iter_documents(str(p), text_key="content")) == ["x", "y"]


def test_bad_json_line_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{"text": broken\n', encoding="utf-8")
    with pytest.raises(SourceError, match=r"bad\.jsonl, line 2: not valid JSON"):
        list(iter_documents(str(p)))


def test_missing_text_key_names_file_line_and_key(tmp_path):
    p = tmp_path / "k.jsonl"
    p.write_text('{"text": "ok"}\n{"body": "no"}\n', encoding="utf-8")
    with pytest.raises(SourceError, match=r"k\.jsonl, line 2: no key 'text'"):
        list(iter_documents(str(p)))


def test_missing_parquet_column(shards):
    with pytest.raises(SourceError, match="no column 'content'"):
        list(iter_documents(str(shards["parquet"]), text_key="content"))


def test_corrupt_gzip_names_the_file(tmp_path):
    p = tmp_path / "x.jsonl.gz"
    p.write_bytes(b"not gzip at all")
    with pytest.raises(SourceError, match=r"x\.jsonl\.gz"):
        list(iter_documents(str(p)))


def test_unknown_format():
    with pytest.raises(SourceError, match="unknown format"):
        detect_format("data.csv")


def test_expand_braces_and_globs(tmp_path):
    assert expand_braces("a{1,2}b{x,y}") == ["a1bx", "a1by", "a2bx", "a2by"]
    assert expand_braces("s.{1..3}-of-3") == ["s.1-of-3", "s.2-of-3", "s.3-of-3"]
    assert expand_braces("{08..10}") == ["08", "09", "10"]
    assert expand_braces("v{1}.jsonl") == ["v{1}.jsonl"]  # as in bash: no comma, no range, literal
    assert expand_braces("{x}-{1,2}") == ["{x}-1", "{x}-2"]
    for name in ("s1.jsonl", "s2.jsonl", "s10.jsonl", "t1.jsonl"):
        write_jsonl(tmp_path / name, ["d"])
    got = expand_urls([str(tmp_path / "s*.jsonl"), str(tmp_path / "{t1,s1}.jsonl")])
    names = [p.rsplit("/", 1)[-1] for p in got]
    assert names == ["s1.jsonl", "s10.jsonl", "s2.jsonl", "t1.jsonl"]  # sorted glob, then braces, no repeats


def test_missing_file_and_empty_glob_name_the_url(tmp_path):
    with pytest.raises(SourceError, match="file not found.*nope.jsonl"):
        expand_urls([str(tmp_path / "nope.jsonl")])
    with pytest.raises(SourceError, match="matches no files"):
        expand_urls([str(tmp_path / "*.jsonl")], what="data.train_urls")
    with pytest.raises(SourceError, match="no input files"):
        expand_urls([])


def test_causal_lm_columns_keep_documents_apart():
    eos = 9
    tokens = np.array([[1, 2, eos, 3, 4, eos, 5, 6]])
    cols = causal_lm_columns(tokens, eos)
    np.testing.assert_array_equal(cols["segment_ids"], [[0, 0, 0, 1, 1, 1, 2, 2]])
    # Position t predicts t+1: masked at EOS (the next token starts another document) and at the end.
    np.testing.assert_array_equal(cols["loss_mask"], [[1, 1, 0, 1, 1, 0, 1, 0]])
    no_eos = causal_lm_columns(tokens, None)
    assert (no_eos["segment_ids"] == 0).all() and no_eos["loss_mask"][0, :-1].all()


@pytest.mark.parametrize("eos", [9, None])
def test_device_columns_equal_host_columns_on_every_short_pattern(eos):
    """``causal_lm_columns_jax`` (what a tokens-only batch gets in the train step) equals the host
    columns, values and dtypes, for every pattern of EOS / other tokens of lengths 1-7 (one row each)."""
    import itertools

    for length in range(1, 8):
        rows = np.array([[9 if b else 3 + i for i, b in enumerate(bits)]
                         for bits in itertools.product([0, 1], repeat=length)], dtype=np.int32)
        host = causal_lm_columns(rows, eos)
        device = causal_lm_columns_jax(rows, eos)
        assert set(device) == set(host)
        for k in host:
            got = np.asarray(device[k])
            assert got.dtype == host[k].dtype, (k, got.dtype, host[k].dtype)
            np.testing.assert_array_equal(got, host[k], err_msg=f"length {length}, {k}")


def _varied_jsonl(n=200):
    lines = (json.dumps({"text": " ".join(str(i * j) for j in range(60))}) + "\n" for i in range(n))
    return "".join(lines).encode()


@pytest.mark.parametrize("cut", ["half", "mid_line", "one_byte_short"])
def test_truncated_zstd_is_reported_as_truncated(tmp_path, cut):
    import zstandard

    blob = zstandard.ZstdCompressor().compress(_varied_jsonl())
    n = {"half": len(blob) // 2, "mid_line": len(blob) - 40, "one_byte_short": len(blob) - 1}[cut]
    p = tmp_path / "cut.jsonl.zst"
    p.write_bytes(blob[:n])
    with pytest.raises(SourceError, match=r"cut\.jsonl\.zst.*truncated"):
        list(iter_documents(str(p)))


def test_multi_frame_zstd_reads_every_frame(tmp_path):
    import zstandard

    data = _varied_jsonl(30)
    lines = data.splitlines(keepends=True)
    c = zstandard.ZstdCompressor()
    p = tmp_path / "frames.jsonl.zst"
    p.write_bytes(c.compress(b"".join(lines[:10])) + c.compress(b"".join(lines[10:])))
    assert len(list(iter_documents(str(p)))) == 30


def test_not_zstd_names_the_file(tmp_path):
    p = tmp_path / "plain.jsonl.zst"
    p.write_bytes(_varied_jsonl(3))
    with pytest.raises(SourceError, match=r"plain\.jsonl\.zst.*(truncated or damaged|not zstd)"):
        list(iter_documents(str(p)))


def test_plain_jsonl_cut_mid_line_says_truncated(tmp_path):
    p = tmp_path / "cut.jsonl"
    p.write_bytes(_varied_jsonl(5)[:-30])
    with pytest.raises(SourceError, match=r"cut\.jsonl, line 5: not valid JSON.*truncated"):
        list(iter_documents(str(p)))


@pytest.mark.parametrize("layout", ["one_line", "pretty"])
def test_json_array_file_gets_a_one_object_per_line_hint(tmp_path, layout):
    p = tmp_path / "docs.json"
    p.write_text(json.dumps([{"text": "a"}, {"text": "b"}], indent=2 if layout == "pretty" else None))
    with pytest.raises(SourceError, match=r"docs\.json, line 1: .*one JSON object per line"):
        list(iter_documents(str(p)))


def test_directory_as_input_names_the_key_and_suggests_a_glob(tmp_path):
    (tmp_path / "shards").mkdir()
    write_jsonl(tmp_path / "shards" / "a.jsonl", ["d"])
    with pytest.raises(SourceError, match=r"data\.train_urls: .*shards' is a directory.*shards/\*\.jsonl"):
        expand_urls([str(tmp_path / "shards")], what="data.train_urls")
    (tmp_path / "more.jsonl").mkdir()  # a directory whose name looks like a data file, matched by a glob
    with pytest.raises(SourceError, match=r"more\.jsonl' is a directory"):
        expand_urls([str(tmp_path / "*.jsonl")], what="data.train_urls")


def test_document_locations_are_one_based_lines_and_rows(tmp_path, shards):
    from levanter.ingest import iter_located_documents

    p = tmp_path / "gaps.jsonl"
    p.write_text('{"text": "a"}\n\n{"text": "b"}\n', encoding="utf-8")
    assert list(iter_located_documents(str(p))) == [("line 1", "a"), ("line 3", "b")]
    rows = list(iter_located_documents(str(shards["parquet"])))
    assert [w for w, _ in rows] == [f"row {i + 1}" for i in range(len(DOCS))]


def test_file_identity_tracks_content_size_and_mtime(tmp_path):
    from levanter.ingest import file_identity

    p = tmp_path / "a.jsonl"
    p.write_bytes(b"x" * 100)
    first = file_identity(str(p))
    assert first == file_identity(str(p))
    st = os.stat(p)
    p.write_bytes(b"y" * 100)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: only the hash can tell
    assert file_identity(str(p))["sha256"] != first["sha256"]
