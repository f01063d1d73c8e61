"""Several ragged fields per example (``input_ids``, ``loss_mask``, ...) kept row-aligned.

A :class:`TreeStore` is one :class:`~levanter.store.jagged_array.JaggedArrayStore` per field, under
``<path>/<field>/``, all holding the same number of rows: row ``i`` of every field belongs to example
``i``. Fields are flat (a name to a 1-D array per example); nested trees are the caller's business to
flatten into names.

Trade-off: fields do not have to share row lengths (a field may hold one value per example while
another holds tokens), so each field keeps its own offsets array. That repeats 8 bytes per row per
field when the lengths do agree, in exchange for one code path and no cross-field invariants to check.

Crash semantics are the jagged store's: the committed row count comes from the ledger and applies to
every field, so fields can never disagree after a resume even if a writer died between field writes.
So are its integrity guarantees, per field: missing chunks are errors (never fill values), new fields'
chunks carry crc32c checksums (``checksum=False`` is passed on like the other store keywords), and a
field missing files that its committed rows need is refused when opened with ``num_rows``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .jagged_array import JaggedArrayStore, append_together

__all__ = ["TreeStore"]


class TreeStore(Mapping[str, JaggedArrayStore]):
    """A mapping of field name to :class:`JaggedArrayStore`, all with the same number of rows."""

    def __init__(self, path: str, stores: Mapping[str, JaggedArrayStore]):
        if not stores:
            raise ValueError("a TreeStore needs at least one field")
        counts = {name: s.num_rows for name, s in stores.items()}
        if len(set(counts.values())) != 1:
            raise ValueError(
                f"fields of the TreeStore at {path!r} disagree on the row count {counts}; "
                "pass num_rows from the cache ledger"
            )
        self.path = path
        self._stores = dict(stores)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        fields: Mapping[str, Any],
        *,
        mode: str,
        num_rows: int | None = None,
        **store_kwargs: Any,
    ) -> "TreeStore":
        """Open one :class:`JaggedArrayStore` per entry of ``fields`` (field name -> dtype, or ``None``
        to accept the stored dtype when opening). ``mode`` and ``num_rows`` mean what they do for
        :meth:`JaggedArrayStore.open` and apply to every field; other keywords (chunk sizes, codec) are
        passed on.
        """
        path = os.fspath(path)
        stores = {}
        for name, dtype in fields.items():
            if not name or "/" in name or name in (".", ".."):
                raise ValueError(f"field name {name!r} cannot be used as a directory name")
            sub = path.rstrip("/") + "/" + name if "://" in path else os.path.join(path, name)
            stores[name] = JaggedArrayStore.open(
                sub, mode=mode, dtype=dtype, num_rows=num_rows, **store_kwargs
            )
        return cls(path, stores)

    # -- mapping -------------------------------------------------------------------------------------
    def __getitem__(self, field: str) -> JaggedArrayStore:
        return self._stores[field]

    def __iter__(self) -> Iterator[str]:
        return iter(self._stores)

    def __len__(self) -> int:
        return len(self._stores)

    @property
    def fields(self) -> list[str]:
        return list(self._stores)

    @property
    def num_rows(self) -> int:
        return next(iter(self._stores.values())).num_rows

    def __repr__(self) -> str:
        return f"TreeStore({self.path!r}, fields={self.fields}, rows={self.num_rows})"

    # -- writing -------------------------------------------------------------------------------------
    def append_columns(self, columns: Mapping[str, Sequence[Any]]) -> None:
        """Append one row per entry of each column; ``columns`` must name every field, columns of equal
        length. All fields' writes are in flight together and no field is written unless all validate.
        """
        if set(columns) != set(self._stores):
            raise KeyError(f"columns {sorted(columns)} do not match the fields {sorted(self._stores)}")
        lengths = {name: len(col) for name, col in columns.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"columns have different numbers of rows: {lengths}")
        names = list(self._stores)
        append_together([self._stores[n] for n in names], [columns[n] for n in names])

    def append(self, examples: Sequence[Mapping[str, Any]]) -> None:
        """Append examples given row-wise (each a mapping of every field to a 1-D array)."""
        columns: dict[str, list[Any]] = {name: [] for name in self._stores}
        for i, ex in enumerate(examples):
            if set(ex) != set(self._stores):
                raise KeyError(f"example {i} has fields {sorted(ex)}, expected {sorted(self._stores)}")
            for name in columns:
                columns[name].append(ex[name])
        self.append_columns(columns)

    def finalize(self) -> None:
        for s in self._stores.values():
            s.finalize()

    # -- reading -------------------------------------------------------------------------------------
    async def read_rows(self, rows: Sequence[int]) -> dict[str, list[np.ndarray]]:
        """Rows of every field, read concurrently: field name -> list of 1-D arrays in ``rows`` order."""
        names = list(self._stores)
        results = await asyncio.gather(*(self._stores[n].read_rows(rows) for n in names))
        return dict(zip(names, results))

    async def read_examples(self, rows: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """Like :meth:`read_rows` but one dict per example."""
        cols = await self.read_rows(rows)
        return [{name: cols[name][i] for name in cols} for i in range(len(rows))]
