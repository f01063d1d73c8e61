"""Scoring requests packed into fixed rows: token ids in, rows for the device out, and back.

A request is the harness's ``(context tokens, continuation tokens)``: the model reads
``context + continuation`` (all but its last token) and the answer is the summed log-probability of the
continuation's tokens and whether each is the model's top choice. Several requests share one row of
``length`` positions, each its own segment (attention stays within a segment; ``positions`` restart at
0 in each, for models with learned absolute positions), so a batch holds many short multiple-choice
requests instead of one padded request per row.

The packing is a pure function of the *set* of requests: identical requests are scored once, and the
distinct ones are sorted by (length, tokens) before first-fit-decreasing placement. Every process of a
multi-process job therefore builds the same rows in the same batches, whatever order the harness handed
it the requests in, and every process takes part in every batch.

The harness's own rule for requests longer than the model (its Hugging Face backend): the context is cut
from the left so that ``context + continuation`` is at most ``length + 1`` tokens; a continuation longer
than ``length`` cannot be scored and is an error.

Trade-off: first-fit-decreasing over a sorted list is O(requests x log(rows)) with a bisect, plus list
insertions; tens of thousands of requests pack in well under a second.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Dict, List, Sequence, Tuple

import numpy as np

__all__ = ["PackedRequests", "pack_requests", "PAD_SEGMENT"]

# The segment id of padding positions: attention never joins them to a request's tokens.
PAD_SEGMENT = -1


@dataclasses.dataclass
class PackedRequests:
    """Rows of ``length`` positions holding every distinct request, and where each request's scored
    positions are. ``index[i]`` is the distinct request answering request ``i``."""

    tokens: np.ndarray  # [rows, length] int32: the model's input
    targets: np.ndarray  # [rows, length] int32: the token each position predicts
    segment_ids: np.ndarray  # [rows, length] int32: the request of each position within its row; PAD_SEGMENT
    positions: np.ndarray  # [rows, length] int32: the position within its request
    scored: np.ndarray  # [rows, length] bool: the continuation's positions
    spans: List[Tuple[int, int, int]]  # per distinct request: (row, first scored position, end)
    index: List[int]  # per request: its distinct request
    truncated: int  # requests whose context was cut from the left

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    def padded_to(self, multiple: int) -> "PackedRequests":
        """The same rows plus rows of padding, so that the row count is a multiple of ``multiple`` (at least one)."""
        rows = max(1, -(-self.num_rows // multiple)) * multiple
        extra = rows - self.num_rows
        if extra == 0:
            return self
        length = self.tokens.shape[1]

        def grow(a, fill):
            return np.concatenate([a, np.full((extra, length), fill, dtype=a.dtype)])

        return dataclasses.replace(self, tokens=grow(self.tokens, 0), targets=grow(self.targets, 0),
                                   segment_ids=grow(self.segment_ids, PAD_SEGMENT), positions=grow(self.positions, 0),
                                   scored=grow(self.scored, False))

    def results(self, logprobs: np.ndarray, greedy: np.ndarray) -> List[Tuple[float, bool]]:
        """Per request, ``(summed log-probability of the continuation, whether every continuation token is
        the top choice)`` from the per-position ``logprobs`` and ``greedy`` of the rows."""
        distinct = []
        for row, start, end in self.spans:
            lp = logprobs[row, start:end].astype(np.float64)
            distinct.append((float(lp.sum()), bool(np.all(greedy[row, start:end]))))
        return [distinct[i] for i in self.index]


def pack_requests(requests: Sequence[Tuple[Sequence[int], Sequence[int]]], length: int, *,
                  max_segments: int = 64) -> PackedRequests:
    """Pack ``(context, continuation)`` token lists into rows of ``length`` positions, at most
    ``max_segments`` requests a row. Raises ``ValueError`` for a request without context or continuation,
    or with a continuation longer than ``length`` tokens."""
    if length < 1:
        raise ValueError(f"rows must hold at least one position, got {length}")
    keys: Dict[Tuple[Tuple[int, ...], int], int] = {}
    distinct: List[Tuple[Tuple[int, ...], int]] = []
    index: List[int] = []
    truncated = 0
    for i, (context, continuation) in enumerate(requests):
        if len(context) == 0 or len(continuation) == 0:
            raise ValueError(f"request {i} has an empty context or continuation (the harness gives both)")
        if len(continuation) > length:
            raise ValueError(
                f"a continuation of {len(continuation)} tokens is longer than the evaluation length ({length} "
                "tokens): raise eval_harness.max_eval_length (at most what the model supports)"
            )
        whole = list(context) + list(continuation)
        if len(whole) > length + 1:
            truncated += 1
            whole = whole[-(length + 1):]
        key = (tuple(int(t) for t in whole), len(continuation))
        k = keys.get(key)
        if k is None:
            k = keys[key] = len(distinct)
            distinct.append(key)
        index.append(k)

    # Longest first, ties by content: a pure function of the set of requests.
    order = sorted(range(len(distinct)), key=lambda k: (-len(distinct[k][0]), distinct[k][0], distinct[k][1]))
    free: List[Tuple[int, int]] = []  # (free positions, row), sorted: best fit by bisect
    fill: List[int] = []  # positions used per row
    count: List[int] = []  # segments per row
    placed: Dict[int, Tuple[int, int, int]] = {}  # (row, start, segment)
    for k in order:
        n = len(distinct[k][0]) - 1
        j = bisect.bisect_left(free, (n, -1))
        if j < len(free):
            _, row = free.pop(j)
        else:
            row = len(fill)
            fill.append(0)
            count.append(0)
        placed[k] = (row, fill[row], count[row])
        fill[row] += n
        count[row] += 1
        if count[row] < max_segments and length - fill[row] > 0:
            bisect.insort(free, (length - fill[row], row))

    rows = len(fill)
    tokens = np.zeros((rows, length), np.int32)
    targets = np.zeros((rows, length), np.int32)
    segment_ids = np.full((rows, length), PAD_SEGMENT, np.int32)
    positions = np.zeros((rows, length), np.int32)
    scored = np.zeros((rows, length), bool)
    spans: List[Tuple[int, int, int]] = [(0, 0, 0)] * len(distinct)
    for k in range(len(distinct)):
        whole, ncont = distinct[k]
        row, start, segment = placed[k]
        n = len(whole) - 1
        end = start + n
        tokens[row, start:end] = whole[:-1]
        targets[row, start:end] = whole[1:]
        segment_ids[row, start:end] = segment
        positions[row, start:end] = np.arange(n)
        scored[row, end - ncont:end] = True
        spans[k] = (row, end - ncont, end)
    return PackedRequests(tokens, targets, segment_ids, positions, scored, spans, index, truncated)
