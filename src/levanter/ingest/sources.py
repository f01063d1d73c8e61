"""Raw documents from files: URL expansion (globs, brace expansion, fsspec) and per-format readers.

Supported inputs: ``.txt`` (the whole file is one document), ``.jsonl`` / ``.json`` (one JSON object per
line, text under ``text_key``), ``.jsonl.gz``, ``.jsonl.zst`` / ``.jsonl.zstd``, ``.parquet`` (column
``text_key``) and ``.arrow`` (Arrow IPC streams, the files ``datasets.Dataset.save_to_disk`` writes;
column ``text_key``). Paths may be local, ``gs://``, ``s3://`` or ``memory://`` URLs (reached through
:mod:`levanter.utils.fs`, which owns endpoints and retries); ``embedded://<name>/<split>`` names a source of
the embedded default corpus (:mod:`levanter.ingest.embedded`), materialised next to the cache on first use.

Everything is deterministic: a URL list expands to the same ordered shard list every time (glob results
sorted), and a shard yields its documents in file order. Errors name the file and the 1-based line (or
parquet row) at fault. Blank lines in JSON-lines files are skipped (consistently, so document counts are
stable).

Completeness: a compressed shard that ends early is an error saying "truncated", never a shorter corpus.
gzip checks this itself; zstd does not (a stream cut inside a block decodes to nothing, silently), so
``.zst`` shards are read through :class:`_ZstdReader`, which raises when the input ends inside a frame.

:func:`file_identity` (from :mod:`levanter.ingest.identity`) is what a token cache records about each input
file, so that a cache is never reused after its inputs changed.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Iterator, Sequence

from ..utils import fs

from .errors import SourceError

__all__ = [
    "check_embedded_url",
    "detect_format",
    "expand_braces",
    "expand_urls",
    "iter_documents",
    "iter_located_documents",
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
    ".arrow": "arrow",
}
EMBEDDED_SCHEME = "embedded://"


def _brace_alternatives(body: str) -> list[str]:
    """``1,2`` -> [1, 2]; ``1..3`` -> [1, 2, 3]; ``01..10`` keeps the zero padding (as bash does)."""
    m = re.fullmatch(r"(-?\d+)\.\.(-?\d+)", body)
    if m is None:
        return body.split(",")
    lo, hi = int(m.group(1)), int(m.group(2))
    padded = m.group(1).startswith("0") or m.group(2).startswith("0")
    width = max(len(m.group(1)), len(m.group(2))) if padded else 0
    step = 1 if hi >= lo else -1
    return [str(i).zfill(width) for i in range(lo, hi + step, step)]


def expand_braces(pattern: str) -> list[str]:
    """``a{1,2}b{x,y}`` -> ``[a1bx, a1by, a2bx, a2by]``; ``{1..3}`` ranges and nesting are supported;
    order preserved. As in bash, braces without a comma or a range are literal: ``v{1}.jsonl`` names
    the file ``v{1}.jsonl``, not ``v1.jsonl``."""
    for m in re.finditer(r"\{([^{}]*)\}", pattern):
        if "," in m.group(1) or re.fullmatch(r"-?\d+\.\.-?\d+", m.group(1)):
            break
    else:
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


def _storage(url: str, what: str, op):
    """``op()``, with a permanent storage error (access denied, missing bucket) named by ``what``."""
    try:
        return op()
    except fs.StorageAccessError:
        raise
    except Exception as e:
        if isinstance(e, (PermissionError,)) or fs.is_permanent(e):
            raise fs.access_error(url, what, e) from None
        raise


def _directory_error(what: str, path: str) -> SourceError:
    return SourceError(
        f"{what}: {path!r} is a directory, not a data file; list its files or use a glob like "
        f"'{path.rstrip('/')}/*.jsonl'"
    )


def expand_urls(
    urls: Sequence[str],
    *,
    embedded_dir: str | None = None,
    what: str = "train_urls",
    allow_empty: bool = False,
    missing_ok: bool = False,
) -> list[str]:
    """Expand braces and globs into an ordered list of existing files (shards).

    Raises :class:`SourceError` naming the URL for a missing file, a glob that matches nothing, or a
    directory; ``missing_ok`` skips missing files and empty globs instead (to see which inputs remain).
    """
    if isinstance(urls, str):
        urls = [urls]
    shards: list[str] = []
    for url in urls:
        if url.startswith(EMBEDDED_SCHEME):
            from .embedded import resolve_embedded_url

            check_embedded_url(url, what=what)
            if embedded_dir is None:
                raise SourceError(
                    f"{what}: {url!r} needs a cache_dir to materialise the embedded corpus into"
                )
            shards.append(resolve_embedded_url(url, embedded_dir))
            continue
        expanded = expand_braces(url)
        # where a brace expansion produced the name, the message also quotes the URL as written
        written = f" (expanded from {url!r})" if expanded != [url] else ""
        for pattern in expanded:
            if any(ch in pattern for ch in "*?["):
                matches = _storage(pattern, what, lambda: fs.glob_detail(pattern))
                if not matches and not missing_ok:
                    raise SourceError(
                        f"{what}: the pattern {pattern!r}{written}{_resolved(pattern)} matches no files"
                    )
                found = []
                for name, is_dir in matches.items():
                    if is_dir:
                        raise _directory_error(what, name)
                    found.append(name)
            else:
                if not _storage(pattern, what, lambda: fs.exists(pattern)):
                    if missing_ok:
                        continue
                    raise SourceError(f"{what}: file not found: {pattern!r}{written}{_resolved(pattern)}")
                if _storage(pattern, what, lambda: fs.isdir(pattern)):
                    raise _directory_error(what, pattern)
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


def _resolved(path: str) -> str:
    """For a relative local path, where it was looked for: `` (resolved to /abs/path from the working
    directory /cwd)``, since a relative path in a config is read from wherever the command runs."""
    if fs.is_url(path) or os.path.isabs(os.path.expanduser(path)):
        return ""
    return f" (resolved to {os.path.abspath(path)} from the working directory {os.getcwd()})"


class _ZstdReader(io.RawIOBase):
    """Decompressed bytes of a (possibly multi-frame) zstd stream; ``EOFError`` if the input ends inside a
    frame, ``OSError`` if it is not zstd data."""

    def __init__(self, raw):
        import zstandard

        self._raw = raw
        self._zstd = zstandard
        self._dec = zstandard.ZstdDecompressor().decompressobj()
        self._in_frame = False  # whether the current frame has received input but not ended
        self._pending = memoryview(b"")  # decompressed bytes not yet handed out

    def readable(self) -> bool:
        return True

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            self._in_frame = True
            try:
                out.append(self._dec.decompress(data))
            except self._zstd.ZstdError as e:
                raise OSError(f"not zstd data or damaged ({e})") from None
            if not self._dec.eof:
                break
            self._in_frame = False
            data = self._dec.unused_data
            self._dec = self._zstd.ZstdDecompressor().decompressobj()
        return b"".join(out)

    def readinto(self, buf) -> int:
        while not self._pending:
            chunk = self._raw.read(1 << 18)
            if not chunk:
                if self._in_frame:
                    raise EOFError("the zstd data ends inside a frame")
                return 0
            self._pending = memoryview(self._decompress(chunk))
        n = min(len(buf), len(self._pending))
        buf[:n] = self._pending[:n]
        self._pending = self._pending[n:]  # a view: no copy of the rest
        return n

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            super().close()


def _open_text(path: str):
    # Invalid UTF-8 is decoded to lone surrogates instead of raising, and reported by _check_utf8 with the
    # line it is on: a strict reader decodes ahead in blocks and fails on whatever line starts the block.
    try:
        if path.lower().endswith((".zst", ".zstd")):
            raw = fs.open_file(path, "rb")
            reader = io.BufferedReader(_ZstdReader(raw), buffer_size=1 << 16)
            return io.TextIOWrapper(reader, encoding="utf-8", errors="surrogateescape")
        return fs.open_file(path, "rt", compression="infer", encoding="utf-8", errors="surrogateescape")
    except FileNotFoundError as e:
        raise SourceError(f"file not found: {path!r}") from e
    except IsADirectoryError:
        raise SourceError(f"{path!r} is a directory, not a data file") from None
    except OSError as e:  # e.g. no permission to read it
        raise SourceError(f"{path}: cannot read the file ({e.strerror or e})") from None
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


_ONE_PER_LINE = (
    "JSON-lines files hold one JSON object per line; convert a file holding one JSON array with "
    "`jq -c '.[]' in.json > out.jsonl`"
)


def iter_documents(path: str, *, text_key: str = "text") -> Iterator[object]:
    """Documents of one shard, in file order: ``str`` for text, or whatever JSON value sits under
    ``text_key`` (a list of token ids for pre-tokenized data)."""
    for _, doc in iter_located_documents(path, text_key=text_key):
        yield doc


def iter_located_documents(path: str, *, text_key: str = "text",
                           key_name: str = "text_key") -> Iterator[tuple[str, object]]:
    """``(where, document)`` pairs of one shard in file order; ``where`` is ``"line N"`` (1-based, for
    JSON lines and text files) or ``"row N"`` (1-based, for parquet and Arrow), as error messages name it.
    ``key_name`` is the config key that chose ``text_key`` (``messages_field`` for chat data), which a
    record or a file without that field names."""
    fmt = detect_format(path)
    if fmt == "txt":
        with _open_text(path) as f:
            try:
                text = f.read()
            except (OSError, EOFError) as e:
                raise SourceError(f"{path}: cannot read the file ({type(e).__name__}: {e})") from e
        _check_utf8(path, text, 1)
        yield "line 1", text
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
                    hint = ""
                    if lineno == 1 and line.lstrip().startswith("["):
                        hint = f"; {_ONE_PER_LINE}"
                    elif not line.endswith("\n"):
                        hint = "; it is the last line and has no newline: the file looks truncated"
                    raise SourceError(
                        f"{path}, line {lineno}: not valid JSON ({why} at column {e.colno}){hint}"
                    ) from None
                if not isinstance(obj, dict):
                    hint = f"; {_ONE_PER_LINE}" if isinstance(obj, list) else ""
                    raise SourceError(
                        f"{path}, line {lineno}: expected a JSON object, got {type(obj).__name__}{hint}"
                    )
                if text_key not in obj:
                    raise SourceError(
                        f"{path}, line {lineno}: no key {text_key!r} ({key_name}); keys present: "
                        f"{sorted(obj)[:10]}{_key_hint(key_name, obj)}"
                    )
                yield f"line {lineno}", obj[text_key]
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(io.BytesIO(fs.read_bytes(path)))
        except FileNotFoundError as e:
            raise SourceError(f"file not found: {path!r}") from e
        except IsADirectoryError:
            raise SourceError(f"{path!r} is a directory, not a data file") from None
        except Exception as e:  # noqa: BLE001 -- pyarrow raises several types for corrupt files
            raise SourceError(f"{path}: not a readable parquet file ({e})") from e
        if text_key not in pf.schema_arrow.names:
            raise SourceError(f"{path}: no column {text_key!r} ({key_name}); columns: {pf.schema_arrow.names}")
        row = 0
        for batch in pf.iter_batches(columns=[text_key], batch_size=1024):
            for value in batch.column(0).to_pylist():
                row += 1
                yield f"row {row}", value
    elif fmt == "arrow":
        yield from _arrow_documents(path, text_key, key_name)


def _key_hint(key_name: str, record: dict) -> str:
    """``; set messages_field: conversations`` when exactly one field of ``record`` holds what ``key_name``
    should name (a list of messages for chat data, a string for text), else nothing."""
    want = list if key_name == "messages_field" else str
    fits = [k for k, v in record.items() if isinstance(v, want)]
    return f"; set {key_name}: {fits[0]}" if len(fits) == 1 else f"; set {key_name} to the field holding each document"


def _arrow_documents(path: str, text_key: str, key_name: str = "text_key") -> Iterator[tuple[str, object]]:
    import pyarrow as pa

    try:
        with fs.open_file(path, "rb") as f:
            reader = pa.ipc.open_stream(f)
            names = reader.schema.names
            if text_key not in names:
                raise SourceError(f"{path}: no column {text_key!r} ({key_name}); columns: {names}")
            row = 0
            for batch in reader:
                for value in batch.column(names.index(text_key)).to_pylist():
                    row += 1
                    yield f"row {row}", value
    except FileNotFoundError as e:
        raise SourceError(f"file not found: {path!r}") from e
    except pa.ArrowInvalid as e:
        raise SourceError(f"{path}: not a readable Arrow stream ({e})") from None
