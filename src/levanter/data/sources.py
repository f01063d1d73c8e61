"""Raw documents from files: URL expansion (globs, brace expansion, fsspec) and per-format readers.

Supported inputs: ``.txt`` (the whole file is one document), ``.jsonl`` / ``.json`` (one JSON object per
line, text under ``text_key``), ``.jsonl.gz``, ``.jsonl.zst`` / ``.jsonl.zstd``, and ``.parquet`` (column
``text_key``). Paths may be local or any fsspec URL; ``embedded://<name>/<split>`` names a source of the
embedded default corpus (:mod:`levanter.data.embedded`), materialised to a local file on first use.

Everything is deterministic: a URL list expands to the same ordered shard list every time (glob results
sorted), and a shard yields its documents in file order. Errors name the file (and line) at fault.
Blank lines in JSON-lines files are skipped (consistently, so document counts are stable).
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator, Sequence

import fsspec

from .errors import SourceError

__all__ = [
    "SourceError",
    "check_embedded_url",
    "detect_format",
    "expand_braces",
    "expand_urls",
    "iter_documents",
]

FORMATS = {
    ".txt": "txt",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".jsonl.gz": "jsonl",
    ".json.gz": "jsonl",
    ".jsonl.zst": "jsonl",
    ".jsonl.zstd": "jsonl",
    ".json.zst": "jsonl",
    ".parquet": "parquet",
}
EMBEDDED_SCHEME = "embedded://"


def _brace_alternatives(body: str) -> list[str]:
    """``1,2`` -> [1, 2]; ``1..3`` -> [1, 2, 3]; ``01..10`` keeps the zero padding (as bash does)."""
    m = re.fullmatch(r"(-?\d+)\.\.(-?\d+)", body)
    if m is None:
        return body.split(",")
    lo, hi = int(m.group(1)), int(m.group(2))
    width = max(len(m.group(1)), len(m.group(2))) if m.group(1).startswith("0") or m.group(2).startswith("0") else 0
    step = 1 if hi >= lo else -1
    return [str(i).zfill(width) for i in range(lo, hi + step, step)]


def expand_braces(pattern: str) -> list[str]:
    """``a{1,2}b{x,y}`` -> ``[a1bx, a1by, a2bx, a2by]``; ``{1..3}`` ranges and nesting are supported;
    order preserved."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end() :]
    out = []
    for alt in _brace_alternatives(m.group(1)):
        out.extend(expand_braces(head + alt + tail))
    return out


def detect_format(path: str) -> str:
    lower = path.lower()
    for suffix in sorted(FORMATS, key=len, reverse=True):
        if lower.endswith(suffix):
            return FORMATS[suffix]
    raise SourceError(
        f"unknown format for {path!r}: supported suffixes are {', '.join(sorted(FORMATS))}"
    )


def check_embedded_url(url: str, *, what: str = "train_urls") -> None:
    """Raise :class:`SourceError` naming ``what`` and ``url`` if an ``embedded://`` URL names no corpus."""
    from .embedded import parse_embedded_url

    try:
        parse_embedded_url(url)
    except ValueError as e:
        raise SourceError(f"{what}: {url!r}: {e}") from None


def expand_urls(
    urls: Sequence[str], *, embedded_dir: str | None = None, what: str = "train_urls", allow_empty: bool = False
) -> list[str]:
    """Expand braces and globs into an ordered list of existing files (shards).

    Raises :class:`SourceError` naming the URL for a missing file or a glob that matches nothing.
    """
    if isinstance(urls, str):
        urls = [urls]
    shards: list[str] = []
    for url in urls:
        if url.startswith(EMBEDDED_SCHEME):
            from .embedded import resolve_embedded_url

            check_embedded_url(url, what=what)
            if embedded_dir is None:
                raise SourceError(f"{what}: {url!r} needs a cache_dir to materialise the embedded corpus into")
            shards.append(resolve_embedded_url(url, embedded_dir))
            continue
        for pattern in expand_braces(url):
            fs, _, _ = fsspec.core.get_fs_token_paths(pattern)
            protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
            if any(ch in pattern for ch in "*?["):
                matches = sorted(fs.glob(pattern))
                if not matches:
                    raise SourceError(f"{what}: the pattern {pattern!r} matches no files")
                found = [m if protocol in ("file", "local") else f"{protocol}://{m}" for m in matches]
            else:
                if not fs.exists(pattern):
                    raise SourceError(f"{what}: file not found: {pattern!r}")
                found = [pattern]
            for f in found:
                try:
                    detect_format(f)
                except SourceError as e:
                    raise SourceError(f"{what}: {e}") from None
                if f not in shards:
                    shards.append(f)
    if not shards and not allow_empty:
        raise SourceError(f"{what}: no input files given")
    return shards


def _open_text(path: str):
    # Invalid UTF-8 is decoded to lone surrogates instead of raising, and reported by _check_utf8 with the
    # line it is on: a strict reader decodes ahead in blocks and fails on whatever line starts the block.
    try:
        return fsspec.open(path, "rt", compression="infer", encoding="utf-8", errors="surrogateescape").open()
    except FileNotFoundError as e:
        raise SourceError(f"file not found: {path!r}") from e
    except ValueError as e:  # e.g. an unknown compression
        raise SourceError(f"cannot open {path!r}: {e}") from e


_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


def _check_utf8(path: str, text: str, first_line: int) -> None:
    """Raise naming the line and column of the first byte of ``text`` that was not valid UTF-8."""
    m = _ESCAPED_BYTE.search(text)
    if m is None:
        return
    line = first_line + text.count("\n", 0, m.start())
    column = m.start() - (text.rfind("\n", 0, m.start()) + 1) + 1
    byte = ord(m.group()) - 0xDC00
    raise SourceError(
        f"{path}, line {line}: not valid UTF-8 (byte 0x{byte:02x} at column {column}); text must be UTF-8"
    )


def iter_documents(path: str, *, text_key: str = "text") -> Iterator[object]:
    """Documents of one shard, in file order: ``str`` for text, or whatever JSON value sits under
    ``text_key`` (a list of token ids for pre-tokenized data)."""
    fmt = detect_format(path)
    if fmt == "txt":
        with _open_text(path) as f:
            try:
                text = f.read()
            except (OSError, EOFError) as e:
                raise SourceError(f"{path}: cannot read the file ({type(e).__name__}: {e})") from e
        _check_utf8(path, text, 1)
        yield text
        return
    if fmt == "jsonl":
        with _open_text(path) as f:
            lineno = 0
            while True:
                try:
                    line = f.readline()
                except (OSError, EOFError) as e:  # truncated or damaged compressed data
                    raise SourceError(
                        f"{path}: cannot read line {lineno + 1} ({type(e).__name__}: {e}); the file is "
                        "truncated or damaged"
                    ) from e
                if not line:
                    return
                lineno += 1
                _check_utf8(path, line, lineno)
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    why = e.msg[: -len(" at")] if e.msg.endswith(" at") else e.msg
                    raise SourceError(
                        f"{path}, line {lineno}: not valid JSON ({why} at column {e.colno})"
                    ) from None
                if not isinstance(obj, dict):
                    raise SourceError(f"{path}, line {lineno}: expected a JSON object, got {type(obj).__name__}")
                if text_key not in obj:
                    raise SourceError(
                        f"{path}, line {lineno}: no key {text_key!r} (text_key); keys present: {sorted(obj)[:10]}"
                    )
                yield obj[text_key]
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            with fsspec.open(path, "rb") as f:
                pf = pq.ParquetFile(io.BytesIO(f.read()))
        except FileNotFoundError as e:
            raise SourceError(f"file not found: {path!r}") from e
        except Exception as e:  # noqa: BLE001 -- pyarrow raises several types for corrupt files
            raise SourceError(f"{path}: not a readable parquet file ({e})") from e
        if text_key not in pf.schema_arrow.names:
            raise SourceError(f"{path}: no column {text_key!r} (text_key); columns: {pf.schema_arrow.names}")
        for batch in pf.iter_batches(columns=[text_key], batch_size=1024):
            yield from batch.column(0).to_pylist()
