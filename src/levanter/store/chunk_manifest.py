"""Position-bound chunk checksums: which checksum belongs at which chunk of which array.

Every chunk a store writes ends with zarr3's ``crc32c`` codec: the CRC-32C of the chunk's bytes, stored as
its last 4 bytes and checked by tensorstore on every read. That catches a flipped bit, not a chunk in the
wrong place: two chunk files swapped (or one copied over another) each still match their own checksum, and
a read would return other tokens than were written there. So a finished store also records, in
``<store>/chunk_checksums.json``, the checksum of every chunk by array and chunk index::

    {"format": "levanter-chunk-checksums-v1",
     "arrays": {"data": {"chunks": 3, "crc32c": ["1a2b3c4d", ...]}, "offsets": {...}}}

Opening a finished cache reads the last 4 bytes of each chunk (one ranged read per chunk, issued together)
and compares them with the record at that position: a chunk whose checksum belongs to another position (or
to no chunk of the cache) fails like a corrupt one, before anything is read from it. The record is a
function of the content alone, so a resumed build writes the same bytes as an uninterrupted one.

Arrays written without the ``crc32c`` codec have no checksums to bind and are not recorded. A store with
checksummed arrays but no record was finished by an older version: :func:`check` reports it, and a token
cache refuses it (``TokenCache.open``) with a message saying to rebuild it -- serving it could return
swapped chunks unnoticed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import tensorstore as ts

from ..utils import fs

__all__ = ["MANIFEST_FILENAME", "check", "has_checksum", "remove", "write"]

MANIFEST_FILENAME = "chunk_checksums.json"
FORMAT = "levanter-chunk-checksums-v1"
_TRAILER = 4  # bytes of crc32c after each chunk


def has_checksum(arr: ts.TensorStore) -> bool:
    """Whether ``arr``'s codec chain ends with ``crc32c`` (its chunks carry a checksum)."""
    codecs = arr.spec().to_json().get("metadata", {}).get("codecs", [])
    return bool(codecs) and codecs[-1].get("name") == "crc32c"


def _chunks(arr: ts.TensorStore) -> int:
    length = int(arr.domain.exclusive_max[0])
    chunk = int(arr.chunk_layout.write_chunk.shape[0])
    return -(-length // chunk)


def _trailers(store_path: str, name: str, count: int, context: ts.Context) -> list[str | None]:
    """The stored checksum (hex) of chunks ``0..count-1`` of array ``name`` (None: chunk missing)."""
    if count == 0:
        return []
    kv = ts.KvStore.open(fs.kvstore_spec(fs.join(store_path, name, "c")), context=context).result()
    keys = [str(k).encode() for k in range(count)]
    futures = [kv.read(key, byte_range=slice(-_TRAILER, None)) for key in keys]
    out: list[str | None] = []
    for key, f in zip(keys, futures):
        try:
            r = f.result()
            value = bytes(r.value)
        except ValueError as e:
            # A server that ignores range requests (some S3-compatible stores, the GCS emulator): read the
            # whole chunk and keep its end.
            if "byte range" not in str(e):
                raise
            r = kv.read(key).result()
            value = bytes(r.value)[-_TRAILER:]
        out.append(value.hex() if r.state == "value" else None)
    return out


def write(store_path: str, arrays: Mapping[str, ts.TensorStore], context: ts.Context) -> None:
    """Record the checksum of every chunk of the checksummed ``arrays`` (a finished store)."""
    record = {name: {"chunks": _chunks(arr), "crc32c": _trailers(store_path, name, _chunks(arr), context)}
              for name, arr in sorted(arrays.items()) if has_checksum(arr)}
    if not record:
        return
    body = json.dumps({"format": FORMAT, "arrays": record}, sort_keys=True, separators=(",", ":")) + "\n"
    fs.atomic_write_bytes(fs.join(store_path, MANIFEST_FILENAME), body.encode("utf-8"))


def remove(store_path: str) -> None:
    """Drop the record of a store reopened for appending (it will change; finishing it writes a new one)."""
    fs.remove(fs.join(store_path, MANIFEST_FILENAME), missing_ok=True)


def check(store_path: str, arrays: Mapping[str, ts.TensorStore], context: ts.Context) -> str | None:
    """What is wrong with the chunk positions of the finished store at ``store_path`` (None: nothing).

    ``"unrecorded"`` when checksummed arrays have no record (a store finished by an older version);
    otherwise a description naming the first misplaced chunk files.
    """
    checked = {name: arr for name, arr in arrays.items() if has_checksum(arr)}
    if not checked:
        return None
    try:
        raw = fs.read_bytes(fs.join(store_path, MANIFEST_FILENAME))
    except FileNotFoundError:
        return "unrecorded"
    try:
        doc = json.loads(raw.decode("utf-8"))
        record = doc["arrays"] if doc.get("format") == FORMAT else None
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, AttributeError, TypeError):
        record = None
    if not isinstance(record, dict):
        return f"{fs.join(store_path, MANIFEST_FILENAME)} cannot be read"
    wrong = []
    for name, arr in sorted(checked.items()):
        entry = record.get(name)
        count = _chunks(arr)
        sums = entry.get("crc32c", ()) if isinstance(entry, dict) else ()
        if not isinstance(entry, dict) or entry.get("chunks") != count or len(sums) != count:
            return f"{fs.join(store_path, MANIFEST_FILENAME)} does not describe the {name} array"
        found = _trailers(store_path, name, count, context)
        wrong += [fs.join(store_path, name, "c", str(k)) for k, (want, got) in
                  enumerate(zip(entry["crc32c"], found)) if want != got]
    if not wrong:
        return None
    shown = ", ".join(wrong[:3]) + (f" and {len(wrong) - 3} more" if len(wrong) > 3 else "")
    files, verb = ("chunk files", "hold") if len(wrong) > 1 else ("chunk file", "holds")
    return f"{files} {shown} {verb} the checksum of another position (chunks swapped or replaced)"
