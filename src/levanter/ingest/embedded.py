"""The embedded default corpus: real text that every Python install already has on disk.

The default training job must run offline on a fresh machine, so its corpus cannot be a download.
CPython's standard library ships two usable kinds of text:

* ``python-docs`` (prose): the language-reference topics in ``pydoc_data/topics.py`` (the text that
  ``help("with")`` prints) plus the docstrings of pure-Python stdlib modules, one document per topic
  and one per module (its module, class, function and method docstrings, each under a heading line).
* ``python-code`` (code): the source of stdlib ``.py`` files, one document per file.

Everything is read by parsing source files with :mod:`ast`, never by importing them: importing
arbitrary stdlib modules has side effects (``antigravity`` opens a browser, ``this`` prints, GUI
modules probe for displays) and would make the corpus depend on which optional C extensions exist.
Even the topics dict is read with ``ast.literal_eval``, so all text comes from one directory.

Selection rules (shared by both sources, so a module's docstrings and its code agree):

* files under a directory named ``test``, ``tests``, ``idle_test``, ``site-packages`` or
  ``__pycache__`` are skipped (test suites are huge, repetitive and full of deliberately broken code);
* ``encodings/`` is skipped (about 1.4 MB of generated codec tables that teach a model nothing),
  as are ``_sysconfigdata*.py`` and ``config-*/`` (build-machine paths: the same Python version
  would give different text on different machines);
* ``python-code`` takes files of at most 200 KB in sorted path order until an 8 MB budget is spent,
  so the selection is deterministic and building a token cache takes seconds. ``python-docs`` has
  its own 4 MB budget (unused on CPython 3.11, where it is about 2.65 MB).

Train/validation split: every document has a *split key*, the module's path relative to the stdlib
(``json/encoder.py``) or ``topics/<name>``. A document is in validation when a stable hash of the
key falls below 2%, topped up with the next-lowest hashes until a source has at least 20 validation
documents. Because the docstrings and the code of one module share a key, a module held out of one
source is (top-ups aside) held out of the other too, so python-docs validation text does not sit
verbatim inside python-code training text.

Trade-off: the content depends on the installed Python (version, distro patches). That is the price
of needing no download; :func:`corpus_fingerprint` hashes the Python version and the selected file
list with sizes, so a cache built from another stdlib is detected rather than silently reused.
Parsing every module for docstrings takes seconds (docs/bench/2026-12-03-cpu-levers.md), so built corpora are
memoised per process (a few MB of strings), and a materialised split records what it was made from (a hidden
stamp beside it: the corpus fingerprint and the file's SHA-256), so a later process that finds the file whole
and the fingerprint unchanged uses it without building the corpus again (a stdlib file edited in place to the
same size goes unnoticed there, as it does for the fingerprint itself).

A directory named by ``LEVANTER_EMBEDDED_DIR`` (unset by default) extends that reuse across cache directories:
each split is materialised there once (stamped the same way), and every process that needs the text, for any
cache directory, copies it from there instead of parsing the stdlib again. The test suite and
``scripts/run_guides.py`` set it, since they start hundreds of processes, each with a new cache directory
(about 3 s of parsing each on a busy 2-core machine); a file there that no longer matches its stamp or the
corpus fingerprint is rebuilt, as in any cache directory.

URLs: ``embedded://<name>/<split>`` (``embedded://python-docs/train``) names a split;
:func:`resolve_embedded_url` materialises it as ``<dir>/<name>/<split>.jsonl`` and returns the path.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import json
import os
import sys
import sysconfig
import tokenize
from collections.abc import Iterator

from ..utils import fs

__all__ = [
    "EMBEDDED_DIR_ENV",
    "EMBEDDED_SOURCES",
    "EMBEDDED_SPLITS",
    "EMBEDDED_URL_SCHEME",
    "corpus_fingerprint",
    "is_embedded_url",
    "iter_embedded_documents",
    "materialize",
    "parse_embedded_url",
    "resolve_embedded_url",
]

EMBEDDED_SOURCES = ("python-docs", "python-code")
EMBEDDED_SPLITS = ("train", "validation")
EMBEDDED_URL_SCHEME = "embedded://"
# The environment variable naming a directory shared by processes: splits materialised once there are copied
# from there (see the module docstring).
EMBEDDED_DIR_ENV = "LEVANTER_EMBEDDED_DIR"

# Bump when the extraction or split rules change: the fingerprint then changes with them, so caches
# built by older code are refused even on the same Python.
_FORMAT_VERSION = 1

_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings"})
_MAX_CODE_FILE_BYTES = 200 * 1024
_CODE_BUDGET_BYTES = 8_000_000
_DOCS_BUDGET_BYTES = 4_000_000

VALIDATION_FRACTION = 0.02
MIN_VALIDATION_DOCS = 20
_SPLIT_SALT = b"levanter-embedded-split-v1:"


def _check_name(name: str) -> None:
    if name not in EMBEDDED_SOURCES:
        raise ValueError(f"unknown embedded corpus {name!r}; valid names: {', '.join(EMBEDDED_SOURCES)}")


def _check_split(split: str) -> None:
    if split not in EMBEDDED_SPLITS:
        raise ValueError(f"unknown embedded split {split!r}; valid splits: {', '.join(EMBEDDED_SPLITS)}")


# -- file selection (cheap: a directory walk and stat calls) -----------------------------------------
def _stdlib_root() -> str:
    # sysconfig's "stdlib" is the base interpreter's library even inside a venv; os.py lives there
    # on every CPython, which makes it a fallback for unusual layouts.
    root = sysconfig.get_paths().get("stdlib")
    if not root or not os.path.isfile(os.path.join(root, "os.py")):
        root = os.path.dirname(os.__file__)
    return root


def _excluded(rel_dir_parts: list[str], filename: str) -> bool:
    if any(p in _EXCLUDED_DIRS or p.startswith("config-") for p in rel_dir_parts):
        return True
    if not rel_dir_parts and filename.startswith("_sysconfigdata"):
        return True
    # The topics module is a data dump (and python-docs' other half); its "docstring" is boilerplate.
    return rel_dir_parts[:1] == ["pydoc_data"]


def _eligible_files(root: str) -> tuple[tuple[str, int], ...]:
    """All eligible ``(relative posix path, size)`` pairs under ``root``, sorted by path."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        parts = [] if rel == os.curdir else rel.split(os.sep)
        if any(p in _EXCLUDED_DIRS or p.startswith("config-") for p in parts):
            dirnames[:] = []  # prune: no need to walk a test suite only to drop it
            continue
        for fn in filenames:
            if fn.endswith(".py") and not _excluded(parts, fn):
                full = os.path.join(dirpath, fn)
                if os.path.isfile(full):
                    out.append(("/".join([*parts, fn]), os.path.getsize(full)))
    out.sort()
    return tuple(out)


def _code_files(root: str) -> list[tuple[str, int]]:
    selected, total = [], 0
    for rel, size in _eligible_files(root):
        if size == 0 or size > _MAX_CODE_FILE_BYTES:
            continue
        if total + size > _CODE_BUDGET_BYTES:
            break  # stop, rather than skip-and-continue: "a prefix of the sorted list" is easy to state
        selected.append((rel, size))
        total += size
    return selected


def _docstring_files(root: str) -> list[tuple[str, int]]:
    # No per-file size cap here: the large modules (_pydecimal) carry some of the best docstrings.
    return [(rel, size) for rel, size in _eligible_files(root) if size > 0]


def _topics_path(root: str) -> str:
    return os.path.join(root, "pydoc_data", "topics.py")


def corpus_fingerprint(name: str) -> str:
    """A hex digest identifying the text :func:`iter_embedded_documents` yields for ``name`` on this Python.

    Covers the interpreter implementation and version, the extraction format and the selected files
    with their sizes; it reads no file contents, so it is cheap enough to check on every start.
    """
    _check_name(name)
    root = _stdlib_root()
    if name == "python-code":
        files = _code_files(root)
    else:
        files = _docstring_files(root)
        topics = _topics_path(root)
        files = [("pydoc_data/topics.py", os.path.getsize(topics) if os.path.exists(topics) else -1), *files]
    payload = {
        "format": _FORMAT_VERSION,
        "name": name,
        "python": [sys.implementation.name, *map(str, sys.version_info)],
        "files": files,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


# -- text extraction ---------------------------------------------------------------------------------
def _clean(text: str) -> str:
    # Source can hold lone surrogates (escapes in string literals end up in docstrings); they cannot
    # be written as UTF-8, so they become U+FFFD. Newlines are normalised so CRLF files match LF ones.
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text.encode("utf-8", "replace").decode("utf-8")


def _read_source(path: str) -> str | None:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        return _clean(raw.decode(encoding).lstrip("\ufeff"))
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return None  # undecodable file: deterministic to drop, and none exist in CPython's stdlib


def _module_name(rel: str) -> str:
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    try:
        return f"({ast.unparse(node.args)})"
    except Exception:  # unparse is best-effort on unusual trees; the docstring is what matters
        return "(...)"


def _docstring_blocks(body: list[ast.stmt], prefix: str) -> Iterator[str]:
    """Heading + docstring for classes, functions and methods, in source order.

    Functions nested inside functions are skipped: they are private helpers whose docstrings
    rarely read as documentation.
    """
    for node in body:
        if isinstance(node, ast.ClassDef):
            qual = f"{prefix}.{node.name}"
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield f"class {qual}\n\n{doc}"
            yield from _docstring_blocks(node.body, qual)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                kw = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
                yield f"{kw} {prefix}.{node.name}{_signature(node)}\n\n{doc}"


def _module_docstrings(rel: str, source: str) -> str:
    try:
        tree = ast.parse(source, filename=rel)
    except (SyntaxError, ValueError):
        return ""
    mod = _module_name(rel)
    blocks = []
    doc = ast.get_docstring(tree, clean=True)
    if doc:
        blocks.append(f"module {mod}\n\n{doc}")
    blocks.extend(_docstring_blocks(tree.body, mod))
    if not blocks:
        return ""
    if not doc:
        blocks.insert(0, f"module {mod}")
    return _clean("\n\n".join(blocks))


def _load_topics(root: str) -> dict[str, str]:
    """The ``topics`` dict of ``<root>/pydoc_data/topics.py`` ({} when the file is absent).

    Read with ``ast.literal_eval`` from the same stdlib directory as everything else rather than
    imported, so the text always matches the files the fingerprint describes.
    """
    path = _topics_path(root)
    source = _read_source(path) if os.path.isfile(path) else None
    if source is None:
        return {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
            value = ast.literal_eval(node.value)
            return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}
    return {}


# A document: (split key, source id, text).
_Doc = tuple[str, str, str]


def _build_docs(root: str) -> list[_Doc]:
    docs: list[_Doc] = []
    topics = _load_topics(root)
    for key in sorted(topics):
        text = _clean(topics[key]).strip()
        if text:
            docs.append((f"topics/{key}", f"topics/{key}", text))
    total = sum(len(t.encode()) for _, _, t in docs)
    for rel, _size in _docstring_files(root):
        source = _read_source(os.path.join(root, *rel.split("/")))
        text = _module_docstrings(rel, source) if source is not None else ""
        if not text.strip():
            continue
        n = len(text.encode())
        if total + n > _DOCS_BUDGET_BYTES:
            break
        docs.append((rel, f"docstrings/{rel}", text))
        total += n
    return docs


def _build_code(root: str) -> list[_Doc]:
    docs: list[_Doc] = []
    for rel, _size in _code_files(root):
        text = _read_source(os.path.join(root, *rel.split("/")))
        if text is not None and text.strip():
            docs.append((rel, rel, text))
    return docs


def _split_hash(key: str) -> int:
    return int.from_bytes(hashlib.sha256(_SPLIT_SALT + key.encode()).digest()[:8], "big")


def _validation_keys(keys: list[str]) -> frozenset[str]:
    """Keys with the lowest split hashes: all below the 2% threshold, at least ``MIN_VALIDATION_DOCS``.

    Ranking by hash rather than thresholding alone guarantees a usable validation set for small
    sources while keeping membership a property of the key (a threshold) in the common case.
    """
    threshold = int(VALIDATION_FRACTION * 2**64)
    ranked = sorted(keys, key=lambda k: (_split_hash(k), k))
    below = sum(1 for k in ranked if _split_hash(k) < threshold)
    n_val = min(len(ranked), max(below, MIN_VALIDATION_DOCS))
    # Never take everything: a source too small for both splits keeps at least one training doc.
    if n_val >= len(ranked):
        n_val = max(0, len(ranked) - 1)
    return frozenset(ranked[:n_val])


@functools.lru_cache(maxsize=len(EMBEDDED_SOURCES))
def _corpus(name: str, fingerprint: str) -> tuple[tuple[_Doc, ...], frozenset[str]]:
    # Keyed on the fingerprint so a stdlib that changes under a long-lived process is rebuilt.
    del fingerprint
    root = _stdlib_root()
    docs = _build_docs(root) if name == "python-docs" else _build_code(root)
    return tuple(docs), _validation_keys([k for k, _, _ in docs])


def iter_embedded_documents(name: str, split: str) -> Iterator[dict]:
    """The documents of one split as ``{"text": ..., "source": ...}`` dicts, in a fixed order.

    ``source`` is ``topics/<topic>``, ``docstrings/<path>`` (python-docs) or ``<path>`` (python-code),
    paths relative to the stdlib directory.
    """
    _check_name(name)
    _check_split(split)
    shared = _shared_dir()
    if shared is not None:
        # Split on "\n" only: the JSON keeps other line separators (U+2028, ...) raw inside its strings.
        for line in fs.read_bytes(_shared_split(name, split, shared, corpus_fingerprint(name))).split(b"\n"):
            if line:
                yield json.loads(line)
        return
    yield from _built_documents(name, split)


def _built_documents(name: str, split: str) -> Iterator[dict]:
    docs, val_keys = _corpus(name, corpus_fingerprint(name))
    want_val = split == "validation"
    for key, source, text in docs:
        if (key in val_keys) == want_val:
            yield {"text": text, "source": source}


# -- materialisation ---------------------------------------------------------------------------------
def materialize(name: str, split: str, out_dir: str) -> str:
    """Write one split as ``<out_dir>/<name>/<split>.jsonl`` (one JSON object per line); return the path.

    ``out_dir`` may be a local directory or a URL. The write is atomic (:func:`levanter.utils.fs.atomic_write_bytes`)
    and skipped when an identical file is already there, so the file's mtime only changes when its content
    does and concurrent writers are safe. Beside the file, ``.<split>.jsonl.stamp`` holds the corpus fingerprint
    and the file's SHA-256: when both still match, the file is used as it is, without building the corpus
    (seconds of parsing for python-docs); any other file (edited, truncated, from another Python) is rebuilt,
    copied from the ``LEVANTER_EMBEDDED_DIR`` directory when one is set (where it is checked the same way).
    """
    _check_name(name)
    _check_split(split)
    return _materialize(name, split, out_dir, use_shared=True)


def _shared_dir() -> str | None:
    return os.environ.get(EMBEDDED_DIR_ENV) or None


def _shared_split(name: str, split: str, shared: str, fingerprint: str) -> str:
    """The path of ``split`` in the shared directory, built there when missing or stale. Building it parses the
    corpus that gives every split of ``name``, so the others are written there with it."""
    if not _is_current(shared, name, split, fingerprint):
        for other in EMBEDDED_SPLITS:
            if other != split:
                _materialize(name, other, shared, use_shared=False, fingerprint=fingerprint)
    return _materialize(name, split, shared, use_shared=False, fingerprint=fingerprint)


def _is_current(out_dir: str, name: str, split: str, fingerprint: str) -> bool:
    """Whether ``out_dir`` holds the split whole, its stamp matching this corpus and the file's content."""
    path = fs.join(out_dir, name, f"{split}.jsonl")
    stamp_path = fs.join(out_dir, name, f".{split}.jsonl.stamp")
    return (fs.isfile(path) and fs.isfile(stamp_path)
            and fs.read_bytes(stamp_path) == _stamp(fingerprint, fs.read_bytes(path)))


def _materialize(name: str, split: str, out_dir: str, *, use_shared: bool, fingerprint: str | None = None) -> str:
    path = fs.join(out_dir, name, f"{split}.jsonl")
    stamp_path = fs.join(out_dir, name, f".{split}.jsonl.stamp")
    fingerprint = fingerprint or corpus_fingerprint(name)
    if _is_current(out_dir, name, split, fingerprint):
        return path
    shared = _shared_dir() if use_shared else None
    if shared is not None:
        # The shared copy is checked against its own stamp (and built there if it fails), so what is copied
        # is what building the corpus here would give.
        blob = fs.read_bytes(_shared_split(name, split, shared, fingerprint))
    else:
        data = "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in _built_documents(name, split))
        blob = data.encode("utf-8")
    if not (fs.isfile(path) and fs.size(path) == len(blob) and fs.read_bytes(path) == blob):
        fs.makedirs(fs.parent(path))
        fs.atomic_write_bytes(path, blob)
    # Written after the file it describes: a stamp never vouches for a file not yet (or no longer) whole.
    fs.atomic_write_bytes(stamp_path, _stamp(fingerprint, blob))
    return path


def _stamp(fingerprint: str, blob: bytes) -> bytes:
    return f"{fingerprint} {hashlib.sha256(blob).hexdigest()}\n".encode()


def is_embedded_url(url: str) -> bool:
    return isinstance(url, str) and url.startswith(EMBEDDED_URL_SCHEME)


def parse_embedded_url(url: str) -> tuple[str, str]:
    """``"embedded://python-docs/train"`` -> ``("python-docs", "train")``; ValueError when malformed."""
    if not is_embedded_url(url):
        raise ValueError(f"not an embedded URL (expected {EMBEDDED_URL_SCHEME}<name>/<split>): {url!r}")
    parts = url[len(EMBEDDED_URL_SCHEME) :].strip("/").split("/")
    if len(parts) != 2:
        raise ValueError(
            f"malformed embedded URL {url!r}: expected {EMBEDDED_URL_SCHEME}<name>/<split> with name in "
            f"{', '.join(EMBEDDED_SOURCES)} and split in {', '.join(EMBEDDED_SPLITS)}"
        )
    name, split = parts
    _check_name(name)
    _check_split(split)
    return name, split


def resolve_embedded_url(url: str, materialize_dir: str) -> str:
    """Materialise the split an ``embedded://<name>/<split>`` URL names; return the ``.jsonl`` path."""
    name, split = parse_embedded_url(url)
    return materialize(name, split, materialize_dir)


def corpus_stats(name: str) -> dict:
    """Document counts and UTF-8 sizes per split (for docs and logs)."""
    _check_name(name)
    stats = {}
    for split in EMBEDDED_SPLITS:
        docs = list(iter_embedded_documents(name, split))
        stats[split] = {"docs": len(docs), "bytes": sum(len(d["text"].encode()) for d in docs)}
    return stats


def _main() -> None:  # python -m levanter.ingest.embedded [out_dir]: materialise everything, print stats
    import time

    out_dir = sys.argv[1] if len(sys.argv) > 1 else None
    for name in EMBEDDED_SOURCES:
        print(name, corpus_fingerprint(name)[:16], json.dumps(corpus_stats(name)))
        if out_dir:
            for split in EMBEDDED_SPLITS:
                t0 = time.perf_counter()
                path = materialize(name, split, out_dir)
                print(f"  {path} ({time.perf_counter() - t0:.2f}s)")


if __name__ == "__main__":
    _main()
