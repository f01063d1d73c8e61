"""Training sequences from a token cache: fixed windows over one token stream, and causal-LM examples.

Index spaces: a :class:`TokenSeqDataset` index ``i`` is the window ``[i * seq_len, (i+1) * seq_len)``
of the cache's flat token stream (store positions). Windows cross document boundaries on purpose --
no token is wasted on padding -- and :class:`CausalLmDataset` keeps documents apart with segment ids
computed from EOS tokens, so attention never crosses a boundary.

Both read whole batches at once (one batched tensorstore read per ``get_batch``) and return column-wise
:class:`~levanter.data.dataset.StackedBatch` / numpy arrays; there is no per-example Python in the path.
``step`` is forwarded unchanged. Both also answer ``plan_read`` (the store views plus the column
computation), so a mixture can read all of its sources' windows in one operation.

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

import numpy as np

from .dataset import AsyncDataset, IndexMap, ReadPlan, StackedBatch, as_index_array, check_range

__all__ = [
    "BLOCK_MAX_SEQ_LEN",
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


class TokenSeqDataset(AsyncDataset[np.ndarray]):
    """Window ``i`` of ``seq_len`` tokens of a store's flat token stream; returns ``int32[n, seq_len]``.

    The trailing ``data_size % seq_len`` tokens are not used. With ``vocab_size`` every read is checked
    to hold only ids in ``[0, vocab_size)`` (see the module docstring).
    """

    def __init__(self, store, seq_len: int, vocab_size: int | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.store = store
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        if vocab_size is None:
            self._finish, self._row_key = _identity, ("windows",)
        else:
            where = getattr(store, "path", repr(store))
            self._finish = functools.partial(_check_token_ids, int(vocab_size), where)
            # Plans with equal keys are finished by one of them: equal bounds, the same check.
            self._row_key = ("windows", int(vocab_size))

    def __len__(self) -> int:
        return self.store.data_size // self.seq_len

    async def get_batch(self, step: int, indices: Sequence[int]) -> np.ndarray:
        idx = as_index_array(indices)
        check_range(idx, len(self), f"TokenSeqDataset(seq_len={self.seq_len})")
        return self._finish(await self.store.read_windows(idx * self.seq_len, self.seq_len))

    async def plan_read(self, step: int, indices: Sequence[int]) -> ReadPlan | None:
        window_views = getattr(self.store, "window_views", None)
        if window_views is None:
            return None
        idx = as_index_array(indices)
        check_range(idx, len(self), f"TokenSeqDataset(seq_len={self.seq_len})")
        return ReadPlan(window_views(idx * self.seq_len, self.seq_len), self._finish, row_key=self._row_key)

    def can_plan_reads(self) -> bool:
        return getattr(self.store, "window_views", None) is not None

    async def plan_reads(self, steps: Sequence[int], indices: Sequence[Sequence[int]]) -> ReadPlan | None:
        """One plan for several steps' windows (the step does not change a window): one view per window,
        or for short windows one index-array view of them all (see :data:`BLOCK_MAX_SEQ_LEN`)."""
        if getattr(self.store, "window_views", None) is None or not len(indices):
            return None
        idx = np.concatenate([as_index_array(i) for i in indices])
        check_range(idx, len(self), f"TokenSeqDataset(seq_len={self.seq_len})")
        starts = idx * self.seq_len
        window_block = getattr(self.store, "window_block", None)
        if window_block is not None and idx.size and self.seq_len <= BLOCK_MAX_SEQ_LEN:
            return ReadPlan([], self._finish, row_key=self._row_key, block=window_block(starts, self.seq_len))
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

    with_mask = True

    def __init__(self, store, mask_store, seq_len: int, vocab_size: int | None = None):
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

    async def plan_read(self, step: int, indices: Sequence[int]) -> ReadPlan | None:
        idx = as_index_array(indices)
        check_range(idx, len(self), f"TokenMaskSeqDataset(seq_len={self.seq_len})")
        return ReadPlan(self._views(idx * self.seq_len), self._finish, row_key=self._row_key)

    def can_plan_reads(self) -> bool:
        return True

    async def plan_reads(self, steps: Sequence[int], indices: Sequence[Sequence[int]]) -> ReadPlan | None:
        """One plan for several steps' windows: a view per window (never the index-array block of short
        windows, which reads one store)."""
        if not len(indices):
            return None
        idx = np.concatenate([as_index_array(i) for i in indices])
        check_range(idx, len(self), f"TokenMaskSeqDataset(seq_len={self.seq_len})")
        return ReadPlan(self._views(idx * self.seq_len), self._finish, row_key=self._row_key)


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


class CausalLmDataset(AsyncDataset[dict]):
    """Causal-LM examples ``{tokens, loss_mask, segment_ids}`` over a dataset of token windows.

    With ``tokens_only=True`` the examples are ``{tokens}``: whoever consumes them derives the other two
    columns with :func:`causal_lm_columns_jax` and this dataset's ``eos_id``. Over a
    :class:`TokenMaskSeqDataset` (a chat cache) the loss mask also needs the stored mask, so
    ``tokens_only`` is refused there.
    """

    def __init__(
        self, token_dataset: AsyncDataset[np.ndarray], eos_id: int | None, *, tokens_only: bool = False
    ):
        self.with_mask = bool(getattr(token_dataset, "with_mask", False))
        if tokens_only and self.with_mask:
            raise ValueError("a chat cache's examples carry their loss mask: tokens_only does not apply")
        self.dataset = token_dataset
        self.eos_id = eos_id
        self.tokens_only = tokens_only

    async def get_batch(self, step: int, indices: Sequence[int]) -> StackedBatch:
        return self._columns(await self.dataset.get_batch(step, indices))

    def _columns(self, windows) -> StackedBatch:
        windows = np.asarray(windows)
        if self.tokens_only:
            return _tokens_column(windows)
        return StackedBatch(_columns(windows, self.eos_id, self.with_mask))

    async def plan_read(self, step: int, indices: Sequence[int]) -> ReadPlan | None:
        return self._then(await self.dataset.plan_read(step, indices))

    async def plan_reads(self, steps: Sequence[int], indices: Sequence[Sequence[int]]) -> ReadPlan | None:
        return self._then(await self.dataset.plan_reads(steps, indices))

    def can_plan_reads(self) -> bool:
        return self.dataset.can_plan_reads()

    async def plan_read_groups(self, steps, indices, group_sizes, where=None) -> list[ReadPlan | None]:
        return [self._then(p) for p in await self.dataset.plan_read_groups(steps, indices, group_sizes, where)]

    async def read_with_provenance(self, step: int, indices: Sequence[int], where: np.ndarray):
        # Rows of the inner dataset, rewritten: the provenance is the inner dataset's.
        examples, provenance = await self.dataset.read_with_provenance(step, indices, where)
        return self._columns(examples), provenance

    async def index_map(self) -> IndexMap:
        return IndexMap(self.dataset, rewrites=True)

    def _then(self, plan: ReadPlan | None) -> ReadPlan | None:
        if plan is None:
            return None
        if self.tokens_only:  # no EOS in the key: the rows are the same whatever the EOS id
            return plan.then(_tokens_column, row_key=("causal_lm_tokens",))
        eos, with_mask = self.eos_id, self.with_mask
        return plan.then(
            lambda windows: StackedBatch(_columns(np.asarray(windows), eos, with_mask)),
            row_key=("causal_lm", eos, with_mask),
        )

    async def async_len(self) -> int:
        return await self.dataset.async_len()

    def is_finite(self) -> bool:
        return self.dataset.is_finite()
