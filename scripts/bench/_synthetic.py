"""Shared by the loader benchmarks on *both* sides (our venv and upstream's): the synthetic token corpus.

Only numpy is imported, so upstream's venv can import this file too. Every source is a deterministic
function of its name index and size: documents of 64..4095 byte-level tokens (ids 0..255), each ended
by EOS = 256, the ids of our ``ByteTokenizer`` and of the HF byte tokenizer that
``upstream_train.py prepare`` writes. Both sides therefore cache exactly the same token streams, and
a seq-1024 window ``i`` of a source holds the same tokens on either side.

The mixture is fixed here too, so both sides read the same 3-source, 2-stage schedule: stage 2 starts
at step 256, where the global offset ``256 * B`` is a multiple of upstream's default
``mixture_block_size`` (2048) for every batch size we use (8, 64, 256); upstream asserts that.
"""

from __future__ import annotations

import numpy as np

EOS = 256
VOCAB = 257
SEQ_LEN = 1024
STAGE_SWITCH_STEP = 256
# Relative sizes (fractions of the total tokens) and stage weights of the three sources.
SOURCES = {"web": 0.5, "code": 0.3, "books": 0.2}
STAGES = [
    (0, {"web": 0.6, "code": 0.3, "books": 0.1}),
    (STAGE_SWITCH_STEP, {"web": 0.3, "code": 0.3, "books": 0.4}),
]


def source_tokens(index: int, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """``(flat int32 tokens, document lengths)`` of about ``n_tokens`` tokens for source ``index``."""
    rng = np.random.default_rng(1000 + index)
    lengths = rng.integers(64, 4096, size=max(1, n_tokens // 2080 + 1), dtype=np.int64)
    ends = np.cumsum(lengths)
    keep = int(np.searchsorted(ends, n_tokens)) + 1
    lengths = lengths[:keep]
    total = int(lengths.sum())
    flat = rng.integers(0, 256, size=total, dtype=np.int32)
    flat[np.cumsum(lengths) - 1] = EOS
    return flat, lengths


def source_sizes(total_tokens: int) -> dict[str, int]:
    return {name: int(total_tokens * frac) for name, frac in SOURCES.items()}
