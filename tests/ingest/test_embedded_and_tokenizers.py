"""Embedded corpus (determinism, split, materialisation, fingerprint) and the tokenizers."""

import json
import os
import shutil

import pytest

from levanter.ingest import embedded
from levanter.ingest.embedded import (
    EMBEDDED_SOURCES,
    EMBEDDED_SPLITS,
    corpus_fingerprint,
    iter_embedded_documents,
    materialize,
    resolve_embedded_url,
)
from levanter.ingest.tokenization import (
    ByteTokenizer,
    HfTokenizer,
    PassthroughTokenizer,
    load_tokenizer,
    train_bpe,
)

UNICODE_SAMPLES = [
    "",
    "hello world",
    "héllo wörld — naïve café",
    "emoji 🙂🚀 and CJK 中文字符 and RTL שלום",
    "tabs\tand\nnewlines\r\n and a NUL \x00 byte",
    "def f(x):\n    return x ** 2  # comment\n",
]


# -- embedded corpus ---------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _no_shared_dir(monkeypatch):
    """These tests build the corpus from the stdlib, without the shared directory tests/conftest.py names
    (LEVANTER_EMBEDDED_DIR); test_a_shared_directory_... sets one of its own."""
    monkeypatch.delenv(embedded.EMBEDDED_DIR_ENV, raising=False)


@pytest.fixture(scope="module")
def corpus():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(embedded.EMBEDDED_DIR_ENV, raising=False)
        return {(n, s): list(iter_embedded_documents(n, s)) for n in EMBEDDED_SOURCES for s in EMBEDDED_SPLITS}


def test_documents_are_deterministic(corpus):
    embedded._corpus.cache_clear()  # rebuild from disk, not from the memo
    for (name, split), docs in corpus.items():
        assert list(iter_embedded_documents(name, split)) == docs, (name, split)


def test_documents_shape_and_sizes(corpus):
    for (name, split), docs in corpus.items():
        assert docs, (name, split)
        for d in docs:
            assert set(d) == {"text", "source"}
            assert isinstance(d["text"], str) and d["text"].strip()
            d["text"].encode("utf-8")  # strict: no lone surrogates survive
    size = {
        name: sum(len(d["text"].encode()) for s in EMBEDDED_SPLITS for d in corpus[(name, s)])
        for name in EMBEDDED_SOURCES
    }
    assert 500_000 < size["python-docs"] <= 4_000_000
    assert 1_000_000 < size["python-code"] <= 8_000_000
    sources = [d["source"] for d in corpus[("python-docs", "train")] + corpus[("python-docs", "validation")]]
    assert any(s.startswith("topics/") for s in sources) and any(s.startswith("docstrings/") for s in sources)


def test_excluded_paths_never_selected(corpus):
    excluded = {"test", "tests", "idle_test", "site-packages", "encodings", "__pycache__"}
    root = embedded._stdlib_root()
    for (name, _), docs in corpus.items():
        for d in docs:
            path = d["source"].removeprefix("docstrings/")
            if path.startswith("topics/"):
                continue
            assert not excluded & set(path.split("/")[:-1]), path
            if name == "python-code":
                assert os.path.getsize(os.path.join(root, path)) <= 200 * 1024


def test_split_disjoint_and_sized(corpus):
    for name in EMBEDDED_SOURCES:
        train = {d["source"] for d in corpus[(name, "train")]}
        val = {d["source"] for d in corpus[(name, "validation")]}
        assert not train & val
        assert len(val) >= embedded.MIN_VALIDATION_DOCS
        assert len(val) < 0.1 * (len(train) + len(val))


def test_split_threshold_shared_across_sources(corpus):
    # A module whose split hash is under the threshold is held out of both sources, so python-docs
    # validation docstrings are not training text in python-code.
    threshold = int(embedded.VALIDATION_FRACTION * 2**64)
    code_train = {d["source"] for d in corpus[("python-code", "train")]}
    for d in corpus[("python-docs", "validation")]:
        key = d["source"].removeprefix("docstrings/")
        if embedded._split_hash(key) < threshold:
            assert key not in code_train


def test_unknown_name_and_split_errors(tmp_path):
    for call in (
        lambda: list(iter_embedded_documents("wikipedia", "train")),
        lambda: corpus_fingerprint("wikipedia"),
        lambda: materialize("wikipedia", "train", str(tmp_path)),
        lambda: resolve_embedded_url("embedded://wikipedia/train", str(tmp_path)),
    ):
        with pytest.raises(ValueError, match="python-docs, python-code"):
            call()
    with pytest.raises(ValueError, match="train, validation"):
        list(iter_embedded_documents("python-docs", "test"))
    with pytest.raises(ValueError, match="train, validation"):
        resolve_embedded_url("embedded://python-docs/dev", str(tmp_path))
    with pytest.raises(ValueError, match="malformed"):
        resolve_embedded_url("embedded://python-docs", str(tmp_path))
    with pytest.raises(ValueError, match="not an embedded URL"):
        resolve_embedded_url("gs://bucket/python-docs/train", str(tmp_path))


def test_materialize_idempotent_and_atomic(tmp_path, corpus, monkeypatch):
    out = str(tmp_path)
    path = materialize("python-docs", "validation", out)
    assert path == os.path.join(out, "python-docs", "validation.jsonl")
    with open(path, encoding="utf-8") as f:
        assert [json.loads(line) for line in f] == corpus[("python-docs", "validation")]

    before = os.stat(path)
    assert resolve_embedded_url("embedded://python-docs/validation", out) == path
    after = os.stat(path)
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)  # no rewrite

    good = open(path, "rb").read()
    with open(path, "ab") as f:
        f.write(b'{"text": "stale"}\n')
    assert materialize("python-docs", "validation", out) == path
    assert open(path, "rb").read() == good  # a differing file is replaced

    # A failure before the rename leaves the old file whole and no temp file behind.
    with open(path, "ab") as f:
        f.write(b"x")
    damaged = open(path, "rb").read()

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(embedded.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        materialize("python-docs", "validation", out)
    monkeypatch.undo()
    assert open(path, "rb").read() == damaged
    assert sorted(os.listdir(os.path.dirname(path))) == [".validation.jsonl.stamp", "validation.jsonl"]


def test_materialize_reuses_a_stamped_file_without_building_the_corpus(tmp_path, corpus):
    """A split whose stamp (corpus fingerprint, file hash) still matches is used as it is: a fresh process
    (here: the per-process corpus memo cleared) does not parse the stdlib again. A file changed behind the
    stamp, even keeping its size, or a stamp from another corpus, makes it build and rewrite the file."""
    out = str(tmp_path)
    path = materialize("python-docs", "validation", out)
    good = open(path, "rb").read()
    embedded._corpus.cache_clear()
    assert materialize("python-docs", "validation", out) == path
    assert embedded._corpus.cache_info().misses == 0  # the corpus was not built

    flipped = bytearray(good)
    flipped[10] = ord("X") if flipped[10] != ord("X") else ord("Y")
    open(path, "wb").write(bytes(flipped))  # same size, other bytes
    assert materialize("python-docs", "validation", out) == path
    assert open(path, "rb").read() == good
    assert embedded._corpus.cache_info().misses == 1

    stamp = os.path.join(out, "python-docs", ".validation.jsonl.stamp")
    open(stamp, "w").write("0" * 64 + open(stamp).read()[64:])  # another corpus's fingerprint
    embedded._corpus.cache_clear()
    assert materialize("python-docs", "validation", out) == path
    assert embedded._corpus.cache_info().misses == 1
    assert open(path, "rb").read() == good


def test_a_shared_directory_builds_each_split_once_for_every_cache_directory(tmp_path, corpus, monkeypatch):
    """With LEVANTER_EMBEDDED_DIR set, a split is built once there, and a process materialising it into
    another directory (or iterating its documents) copies it from there without parsing the stdlib; the
    copies are byte for byte what a build gives. A shared file changed behind its stamp is rebuilt."""
    built = materialize("python-docs", "validation", str(tmp_path / "built"))  # no shared directory
    shared = tmp_path / "shared"
    monkeypatch.setenv(embedded.EMBEDDED_DIR_ENV, str(shared))
    embedded._corpus.cache_clear()
    first = materialize("python-docs", "validation", str(tmp_path / "a"))
    assert embedded._corpus.cache_info().misses == 1  # built once, in the shared directory
    shared_file = shared / "python-docs" / "validation.jsonl"
    assert open(first, "rb").read() == open(built, "rb").read() == shared_file.read_bytes()
    assert (shared / "python-docs" / "train.jsonl").is_file()  # the corpus parsed once gives both splits

    embedded._corpus.cache_clear()  # as in a new process
    second = materialize("python-docs", "validation", str(tmp_path / "b"))
    for split in EMBEDDED_SPLITS:
        assert list(iter_embedded_documents("python-docs", split)) == corpus[("python-docs", split)]
    assert embedded._corpus.cache_info().misses == 0  # copied and read, not built
    assert open(second, "rb").read() == open(built, "rb").read()

    good = shared_file.read_bytes()
    shared_file.write_bytes(good.replace(b'"text"', b'"TEXT"', 1))  # same size, other bytes
    third = materialize("python-docs", "validation", str(tmp_path / "c"))
    assert embedded._corpus.cache_info().misses == 1
    assert open(third, "rb").read() == shared_file.read_bytes() == good


def test_fingerprint_stable_and_distinct():
    fps = {n: corpus_fingerprint(n) for n in EMBEDDED_SOURCES}
    assert fps == {n: corpus_fingerprint(n) for n in EMBEDDED_SOURCES}
    assert len(set(fps.values())) == len(EMBEDDED_SOURCES)
    assert all(len(fp) == 64 for fp in fps.values())


def _write(root, rel, text):
    path = os.path.join(root, *rel.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def test_fake_stdlib_extraction_and_fingerprint(tmp_path, monkeypatch):
    root = str(tmp_path / "lib")
    _write(root, "os.py", '"""Operating system stuff."""\n\ndef getcwd():\n    """Return the cwd."""\n')
    _write(root, "pkg/__init__.py", "class Thing:\n    async def run(self, x, *, y=1):\n        'Run it.'\n")
    _write(root, "pkg/test/test_thing.py", '"""Tests are skipped."""\n')
    _write(root, "encodings/cp999.py", '"""Codec tables are skipped."""\n')
    _write(root, "pydoc_data/topics.py", "# generated\ntopics = {'with': 'The with statement\\n'}\n")
    monkeypatch.setattr(embedded, "_stdlib_root", lambda: root)
    embedded._corpus.cache_clear()
    try:
        fp = {n: corpus_fingerprint(n) for n in EMBEDDED_SOURCES}
        docs = {d["source"]: d["text"] for s in EMBEDDED_SPLITS for d in iter_embedded_documents("python-docs", s)}
        assert docs["topics/with"] == "The with statement"
        assert docs["docstrings/os.py"] == (
            "module os\n\nOperating system stuff.\n\ndef os.getcwd()\n\nReturn the cwd."
        )
        assert docs["docstrings/pkg/__init__.py"] == (
            "module pkg\n\nasync def pkg.Thing.run(self, x, *, y=1)\n\nRun it."
        )
        assert len(docs) == 3
        code = {d["source"] for s in EMBEDDED_SPLITS for d in iter_embedded_documents("python-code", s)}
        assert code == {"os.py", "pkg/__init__.py"}

        _write(root, "new.py", "x = 1\n")  # another stdlib: both fingerprints move
        assert all(corpus_fingerprint(n) != fp[n] for n in EMBEDDED_SOURCES)
        assert "new.py" in {d["source"] for s in EMBEDDED_SPLITS for d in iter_embedded_documents("python-code", s)}
    finally:
        embedded._corpus.cache_clear()


# -- tokenizers --------------------------------------------------------------------------------------
def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eos_token_id, tok.bos_token_id) == (257, 256, None)
    ids = tok.encode_batch(UNICODE_SAMPLES)
    for text, seq in zip(UNICODE_SAMPLES, ids):
        assert seq == list(text.encode("utf-8"))
        assert tok.decode(seq) == text
    assert tok.decode(tok.encode("a") + [256] + tok.encode("é")) == "a<|endoftext|>é"
    assert ByteTokenizer(320).vocab_size == 320
    assert ByteTokenizer(320).fingerprint() != tok.fingerprint()
    with pytest.raises(ValueError, match="257"):
        ByteTokenizer(200)


@pytest.fixture(scope="module")
def bpe_texts(corpus):
    texts, n = [], 0
    for d in corpus[("python-docs", "train")] + corpus[("python-code", "train")][::10]:
        if n > 300_000:
            break
        texts.append(d["text"])
        n += len(d["text"].encode())
    return texts


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory, bpe_texts):
    out = str(tmp_path_factory.mktemp("bpe512"))
    train_bpe(bpe_texts, 512, out)
    return out


def test_bpe_round_trip_and_loading(bpe_dir, corpus):
    tok = load_tokenizer(bpe_dir)
    assert isinstance(tok, HfTokenizer)
    assert tok.vocab_size == 512
    assert tok.eos_token_id == tok.backend.token_to_id("<|endoftext|>")
    held_out = [d["text"] for d in corpus[("python-docs", "validation")][:5]]
    texts = UNICODE_SAMPLES + held_out
    ids = tok.encode_batch(texts)
    assert all(0 <= i < tok.vocab_size for seq in ids for i in seq)
    assert tok.eos_token_id not in {i for seq in ids for i in seq}  # no special tokens added
    for text, seq in zip(texts, ids):
        assert tok.decode(seq) == text
    # compresses: fewer tokens than bytes on held-out prose
    assert sum(map(len, ids[len(UNICODE_SAMPLES) :])) < 0.6 * sum(len(t.encode()) for t in held_out)

    from_file = load_tokenizer(os.path.join(bpe_dir, "tokenizer.json"))
    assert from_file.fingerprint() == tok.fingerprint()
    assert from_file.encode_batch(texts) == ids


def test_bpe_training_is_deterministic(bpe_dir, bpe_texts, tmp_path):
    again = train_bpe(bpe_texts, 512, str(tmp_path))
    assert open(os.path.join(bpe_dir, "tokenizer.json"), "rb").read() == open(
        os.path.join(str(tmp_path), "tokenizer.json"), "rb"
    ).read()
    assert again.fingerprint() == load_tokenizer(bpe_dir).fingerprint()


def test_fingerprints_identify_content(bpe_dir, bpe_texts, tmp_path):
    base = load_tokenizer(bpe_dir)
    other = train_bpe(bpe_texts[: len(bpe_texts) // 2], 512, str(tmp_path / "other"))
    assert other.fingerprint() != base.fingerprint()
    assert base.fingerprint() != ByteTokenizer().fingerprint()
    # Content, not location: a copy elsewhere (without tokenizer_config.json) matches.
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(os.path.join(bpe_dir, "tokenizer.json"), copy / "tokenizer.json")
    moved = load_tokenizer(str(copy))
    assert moved.eos_token_id == base.eos_token_id  # found among the common special tokens
    assert moved.fingerprint() == base.fingerprint()
    json.dumps(base.fingerprint())


def test_load_tokenizer_errors(tmp_path, monkeypatch):
    missing = str(tmp_path / "no" / "such" / "tokenizer")
    with pytest.raises(ValueError, match="does not exist") as e:
        load_tokenizer(missing)
    assert missing in str(e.value)
    for spec in ("./nope", "nope/tokenizer.json", "~/no-such-dir-levanter"):
        with pytest.raises(ValueError, match="does not exist"):
            load_tokenizer(spec)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))

    with pytest.raises(ValueError, match="vocab_size"):
        load_tokenizer("passthrough")
    pt = load_tokenizer("passthrough", vocab_size=50_000)
    assert isinstance(pt, PassthroughTokenizer) and pt.vocab_size == 50_000
    with pytest.raises(TypeError, match="pre-tokenized"):
        pt.encode_batch(["text"])
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert load_tokenizer("byte", vocab_size=384).vocab_size == 384

    # A hub name that cannot be fetched (offline): the error names it and the offline options.
    import tokenizers

    class Offline:
        @staticmethod
        def from_pretrained(name):
            raise OSError("Name or service not known")

    monkeypatch.setattr(tokenizers, "Tokenizer", Offline)
    with pytest.raises(ValueError) as e:
        load_tokenizer("some-org/some-tokenizer")
    msg = str(e.value)
    for part in ("'some-org/some-tokenizer'", "'byte'", "'passthrough'", "local"):
        assert part in msg
