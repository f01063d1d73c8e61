"""Training sequences from a token cache: fixed windows over one token stream, and causal-LM examples.

Index spaces: a :class:`TokenSeqDataset` index ``i`` is the window ``[i * seq_len, (i+1) * seq_len)``
of the cache's flat token stream (store positions). Windows cross document boundaries on purpose --
no token is wasted on padding -- and :class:`CausalLmDataset` keeps documents apart with segment ids
computed from EOS tokens, so attention never crosses a boundary.

Both read whole batches at once (one batched tensorstore read per ``get_batch``) and return column-wise
:class:`~levanter.data.dataset.StackedBatch` / numpy arrays; there is no per-example Python in the path.
``step`` is forwarded unchanged. Both also answer ``plan_read`` (the store views plus the column
computation), so a mixture can read all of its sources' windows in one operation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .dataset import AsyncDataset, ReadPlan, StackedBatch, _check_range, as_index_array


class TokenSeqDataset(AsyncDataset[np.ndarray]):
    """Window ``i`` of ``seq_len`` tokens of a store's flat token stream; returns ``int32[n, seq_len]``.

    The trailing ``data_size % seq_len`` tokens are not used.
    """

    def __init__(self, store, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.store = store
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.store.data_size // self.seq_len

    async def get_batch(self, step: int, indices: Sequence[int]) -> np.ndarray:
        idx = as_index_array(indices)
        _check_range(idx, len(self), f"TokenSeqDataset(seq_len={self.seq_len})")
        return await self.store.read_windows(idx * self.seq_len, self.seq_len)

    async def plan_read(self, step: int, indices: Sequence[int]) -> ReadPlan | None:
        window_views = getattr(self.store, "window_views", None)
        if window_views is None:
            return None
        idx = as_index_array(indices)
        _check_range(idx, len(self), f"TokenSeqDataset(seq_len={self.seq_len})")
        return ReadPlan(window_views(idx * self.seq_len, self.seq_len), _identity, row_key=("windows",))

    async def async_len(self) -> int:
        return len(self)

    def is_finite(self) -> bool:
        return True


def _identity(x):
    return x


def causal_lm_columns(tokens: np.ndarray, eos_id: int | None) -> dict[str, np.ndarray]:
    """``tokens``, ``loss_mask`` and ``segment_ids`` for a batch of windows ``int[n, L]``.

    Segment ids count the EOS tokens before each position, so a document's EOS belongs to it and the
    next document starts a new segment. Position ``t`` is trained to predict ``t + 1``; the loss is
    masked where that would cross a document boundary (``tokens[t] == eos``) and at the last position.
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
    return {"tokens": tokens.astype(np.int32, copy=False), "loss_mask": loss_mask, "segment_ids": segment_ids}


class CausalLmDataset(AsyncDataset[dict]):
    """Causal-LM examples ``{tokens, loss_mask, segment_ids}`` over a dataset of token windows."""

    def __init__(self, token_dataset: AsyncDataset[np.ndarray], eos_id: int | None):
        self.dataset = token_dataset
        self.eos_id = eos_id

    async def get_batch(self, step: int, indices: Sequence[int]) -> StackedBatch:
        windows = np.asarray(await self.dataset.get_batch(step, indices))
        return StackedBatch(causal_lm_columns(windows, self.eos_id))

    async def plan_read(self, step: int, indices: Sequence[int]) -> ReadPlan | None:
        plan = await self.dataset.plan_read(step, indices)
        if plan is None:
            return None
        eos = self.eos_id
        return plan.then(
            lambda windows: StackedBatch(causal_lm_columns(np.asarray(windows), eos)),
            row_key=("causal_lm", eos),
        )

    async def async_len(self) -> int:
        return await self.dataset.async_len()

    def is_finite(self) -> bool:
        return self.dataset.is_finite()
