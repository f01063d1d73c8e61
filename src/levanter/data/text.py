"""Training sequences from a token cache: fixed windows over one token stream, and causal-LM examples.

Index spaces: a :class:`TokenSeqDataset` index ``i`` is the window ``[i * seq_len, (i+1) * seq_len)``
of the cache's flat token stream (store positions). Windows cross document boundaries on purpose --
no token is wasted on padding -- and :class:`CausalLmDataset` keeps documents apart with segment ids
computed from EOS tokens, so attention never crosses a boundary.

Both read whole batches at once (one batched tensorstore read per ``get_batch``) and return column-wise
:class:`~levanter.data.dataset.StackedBatch` / numpy arrays; there is no per-example Python in the path.
``step`` is forwarded unchanged. Both also answer ``plan`` (the store views plus the column
computation), so a mixture can read all of its sources' windows in one operation. A store that can be
planned is a :class:`WindowStore` (its windows as views, unread); any other store is read with its
``read_windows``.

``loss_mask`` and ``segment_ids`` are a pure function of the tokens and the EOS id
(:func:`causal_lm_columns`, and :func:`causal_lm_columns_jax`, the same function in jax) -- and, for a chat
cache, of its stored per-token assistant mask: :class:`TokenMaskSeqDataset` reads each window of tokens and
the same window of the mask as one view (tokens then mask, ``int32[n, 2 * seq_len]``, still one batched read
per step), and position ``t`` is trained only where token ``t + 1`` is an assistant token. Such a dataset
always ships its loss mask (never ``tokens_only``), since the device cannot derive it. A
``CausalLmDataset(..., tokens_only=True)`` ships the tokens alone and leaves the other two to the
device, inside the jitted step (``train_lm`` does this): one host array and one transfer per step
instead of three, and no host cumsum (docs/bench/2026-12-03-cpu-levers.md).

Token ids are checked against the vocabulary where a :class:`TokenSeqDataset` is given ``vocab_size``
(``train_lm``'s datasets are): an id outside ``[0, vocab_size)`` can only come from a damaged cache (a
chunk of random bytes in a cache written before chunks carried checksums) and is refused, naming the
cache, instead of reaching the model as an out-of-range embedding lookup and a NaN loss. The check is one
``min``/``max`` over each read's tokens, once per read (a coalesced read of many steps is checked once).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .dataset import AsyncDataset, WrapperDataset
from .read_plan import ReadPlan, StackedBatch, as_index_array, check_range, group_sizes_of, with_provenance

__all__ = [
    "BLOCK_MAX_SEQ_LEN",
    "TokenStore",
    "WindowStore",
    "TokenSeqDataset",
    "TokenMaskSeqDataset",
    "causal_lm_columns",
    "causal_lm_columns_jax",
    "CausalLmDataset",
]

# Windows of at most this many tokens are planned many at a time as one index-array view
# (``JaggedArrayStore.window_block``) instead of a view each: making a view costs Python per window, and
# tensorstore reads short windows from an index array with no more CPU than from separate views. It
# walks an index array element by element, though, so for long windows separate views are cheaper
# (the crossover was measured at 64-128 tokens: docs/bench/2026-12-03-cpu-levers.md).
BLOCK_MAX_SEQ_LEN = 64


@runtime_checkable
class TokenStore(Protocol):
    """What a :class:`TokenSeqDataset` reads: a flat token stream of ``data_size`` tokens at ``path``."""

    path: str
    data_size: int

    async def read_windows(self, starts: Any, length: int) -> np.ndarray: ...


@runtime_checkable
class WindowStore(TokenStore, Protocol):
    """A :class:`TokenStore` whose windows can be planned: views of them, unread, to be read with other
    sources' in one tensorstore operation (``JaggedArrayStore``)."""

    def window_views(self, starts: Any, length: int) -> list: ...

    def window_block(self, starts: Any, length: int) -> Any: ...


class TokenSeqDataset(AsyncDataset[np.ndarray]):
    """Window ``i`` of ``seq_len`` tokens of a store's flat token stream; returns ``int32[n, seq_len]``.

    The trailing ``data_size % seq_len`` tokens are not used. With ``vocab_size`` every read is checked
    to hold only ids in ``[0, vocab_size)`` (see the module docstring).
    """

    def __init__(self, store: TokenStore, seq_len: int, vocab_size: int | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.store = store
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self._plannable = isinstance(store, WindowStore)
        if vocab_size is None:
            self._finish, self._row_key = _identity, ("windows",)
        else:
            self._finish = functools.partial(_check_token_ids, int(vocab_size), store.path)
            # Plans with equal keys are finished by one of them: equal bounds, the same check.
            self._row_key = ("windows", int(vocab_size))

    def __len__(self) -> int:
        return self.store.data_size // self.seq_len

    async def get_batch(self, step: int, indices: Sequence[int]) -> np.ndarray:
        idx = as_index_array(indices)
        check_range(idx, len(self), f"TokenSeqDataset(seq_len={self.seq_len})")
        return self._finish(await self.store.read_windows(idx * self.seq_len, self.seq_len))

    async def plan(self, steps, indices, group_sizes=None, where=None) -> list[ReadPlan | None]:
        """A plan per group of steps (the step does not change a window): a view per window, or for
        short windows one index-array view of them all (see :data:`BLOCK_MAX_SEQ_LEN`)."""
        sizes = group_sizes_of(steps, group_sizes)
        if not self._plannable:
            return [None] * len(sizes)
        plans, at = [], 0
        for size in sizes:
            plans.append(self._plan_group(indices[at : at + size]) if size else None)
            at += size
        return with_provenance(plans, where)

    def _starts(self, indices: Sequence[Sequence[int]]) -> np.ndarray:
        idx = np.concatenate([as_index_array(i) for i in indices])
        check_range(idx, len(self), f"{type(self).__name__}(seq_len={self.seq_len})")
        return idx * self.seq_len

    def _plan_group(self, indices: Sequence[Sequence[int]]) -> ReadPlan:
        starts = self._starts(indices)
        if starts.size and self.seq_len <= BLOCK_MAX_SEQ_LEN:
            block = self.store.window_block(starts, self.seq_len)
            return ReadPlan([], self._finish, row_key=self._row_key, block=block)
        return ReadPlan(self.store.window_views(starts, self.seq_len), self._finish, row_key=self._row_key)

    async def async_len(self) -> int:
        return len(self)

    def is_finite(self) -> bool:
        return True


class TokenMaskSeqDataset(TokenSeqDataset):
    """Window ``i`` of a chat cache's tokens and of its per-token mask, side by side: ``int32[n, 2 * seq_len]``
    (``[:, :seq_len]`` the tokens, ``[:, seq_len:]`` the mask, 1 on assistant tokens). Each window is one view
    (the mask store's view cast to int32 and concatenated after the tokens'), so planned reads of many
    windows and sources stay one tensorstore operation."""

    def __init__(self, store: WindowStore, mask_store: WindowStore, seq_len: int, vocab_size: int | None = None):
        super().__init__(store, seq_len, vocab_size)
        if mask_store.data_size != store.data_size:
            raise ValueError(
                f"the mask store {mask_store.path!r} holds {mask_store.data_size} values for {store.data_size} tokens"
            )
        self.mask_store = mask_store
        check = self._finish
        n = seq_len
        self._finish = lambda rows: _check_tokens_of_pairs(check, n, rows)
        self._row_key = ("token_mask_windows", *self._row_key[1:])

    def _views(self, starts) -> list:
        import tensorstore as ts

        tokens = self.store.window_views(starts, self.seq_len)
        masks = self.mask_store.window_views(starts, self.seq_len)
        return [ts.concat([t, ts.cast(m, ts.int32)], axis=0) for t, m in zip(tokens, masks)]

    async def get_batch(self, step: int, indices: Sequence[int]) -> np.ndarray:
        from ..store import awaited, read_stacked

        idx = as_index_array(indices)
        check_range(idx, len(self), f"TokenMaskSeqDataset(seq_len={self.seq_len})")
        if not idx.size:
            return np.empty((0, 2 * self.seq_len), dtype=np.int32)
        return self._finish(await awaited(read_stacked(self._views(idx * self.seq_len))))

    def _plan_group(self, indices: Sequence[Sequence[int]]) -> ReadPlan:
        # A view per window, never the index-array block of short windows (which reads one store).
        return ReadPlan(self._views(self._starts(indices)), self._finish, row_key=self._row_key)


def _check_tokens_of_pairs(check, seq_len: int, rows):
    rows = np.asarray(rows)
    check(rows[:, :seq_len])
    return rows


def _identity(x):
    return x


def _check_token_ids(vocab_size: int, store_path: str, windows):
    """``windows``, if every id is in ``[0, vocab_size)``; otherwise the cache at ``store_path`` is damaged."""
    w = np.asarray(windows)
    if w.size and (w.min() < 0 or w.max() >= vocab_size):
        from ..store.faults import cache_root

        bad = int(w[(w < 0) | (w >= vocab_size)].flat[0])
        raise ValueError(
            f"the cache at {cache_root(store_path)} is damaged: it holds token id {bad}, outside the vocabulary "
            f"[0, {vocab_size}) (a chunk of other bytes); delete it to rebuild"
        )
    return windows


def causal_lm_columns(tokens: np.ndarray, eos_id: int | None, assistant: np.ndarray | None = None
                      ) -> dict[str, np.ndarray]:
    """``tokens``, ``loss_mask`` and ``segment_ids`` for a batch of windows ``int[n, L]``.

    Segment ids count the EOS tokens before each position, so a document's EOS belongs to it and the
    next document starts a new segment. Position ``t`` is trained to predict ``t + 1``; the loss is
    masked where that would cross a document boundary (``tokens[t] == eos``) and at the last position.
    With ``assistant`` (a chat cache's per-token mask, ``[n, L]``), also wherever token ``t + 1`` is not an
    assistant token: only the assistant's tokens are predicted.
    """
    n, length = tokens.shape
    if eos_id is None:
        is_eos = np.zeros_like(tokens, dtype=bool)
    else:
        is_eos = tokens == eos_id
    segment_ids = np.zeros((n, length), dtype=np.int32)
    if length > 1:
        np.cumsum(is_eos[:, :-1], axis=1, out=segment_ids[:, 1:])
    loss_mask = ~is_eos
    loss_mask[:, -1] = False
    if assistant is not None and length > 1:
        loss_mask[:, :-1] &= np.asarray(assistant)[:, 1:] != 0
    return {"tokens": tokens.astype(np.int32, copy=False), "loss_mask": loss_mask, "segment_ids": segment_ids}


def causal_lm_columns_jax(tokens, eos_id: int | None) -> dict:
    """:func:`causal_lm_columns` in jax (to run inside a jitted step): the same values and dtypes."""
    import jax.numpy as jnp

    tokens = jnp.asarray(tokens)
    if eos_id is None:
        is_eos = jnp.zeros(tokens.shape, dtype=bool)
    else:
        is_eos = tokens == eos_id
    before = jnp.cumsum(is_eos[:, :-1].astype(jnp.int32), axis=1, dtype=jnp.int32)
    segment_ids = jnp.concatenate([jnp.zeros_like(tokens[:, :1], dtype=jnp.int32), before], axis=1)
    last = jnp.arange(tokens.shape[1]) == tokens.shape[1] - 1
    loss_mask = ~is_eos & ~last[None, :]
    return {"tokens": tokens.astype(jnp.int32), "loss_mask": loss_mask, "segment_ids": segment_ids}


def _columns(windows: np.ndarray, eos_id: int | None, with_mask: bool) -> dict[str, np.ndarray]:
    if not with_mask:
        return causal_lm_columns(windows, eos_id)
    half = windows.shape[1] // 2  # tokens, then the assistant mask (TokenMaskSeqDataset)
    return causal_lm_columns(windows[:, :half], eos_id, windows[:, half:])


def _tokens_column(windows) -> StackedBatch:
    return StackedBatch({"tokens": np.asarray(windows).astype(np.int32, copy=False)})


class CausalLmDataset(WrapperDataset[dict]):
    """Causal-LM examples ``{tokens, loss_mask, segment_ids}`` over a dataset of token windows.

    With ``tokens_only=True`` the examples are ``{tokens}``: whoever consumes them derives the other two
    columns with :func:`causal_lm_columns_jax` and this dataset's ``eos_id``. Over a
    :class:`TokenMaskSeqDataset` (a chat cache) the loss mask also needs the stored mask, so
    ``tokens_only`` is refused there.
    """

    def __init__(
        self, token_dataset: AsyncDataset[np.ndarray], eos_id: int | None, *, tokens_only: bool = False
    ):
        super().__init__(token_dataset)
        self.with_mask = isinstance(token_dataset, TokenMaskSeqDataset)
        if tokens_only and self.with_mask:
            raise ValueError("a chat cache's examples carry their loss mask: tokens_only does not apply")
        self.eos_id = eos_id
        self.tokens_only = tokens_only

    def _rewrite(self, windows, n: int) -> StackedBatch:
        windows = np.asarray(windows)
        if self.tokens_only:
            return _tokens_column(windows)
        return StackedBatch(_columns(windows, self.eos_id, self.with_mask))

    def _rewrite_plan(self, plan: ReadPlan, steps: int) -> ReadPlan:
        if self.tokens_only:  # no EOS in the key: the rows are the same whatever the EOS id
            return plan.then(_tokens_column, row_key=("causal_lm_tokens",))
        eos, with_mask = self.eos_id, self.with_mask
        return plan.then(
            lambda windows: StackedBatch(_columns(np.asarray(windows), eos, with_mask)),
            row_key=("causal_lm", eos, with_mask),
        )
