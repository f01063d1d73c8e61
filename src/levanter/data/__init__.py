"""Training data: step-indexed datasets, the mixture, the loader, and the data configs.

The doors of the package (everything a caller outside it needs), imported on first use so that
importing ``levanter.data`` stays cheap and no part of it imports another through this file:

* datasets (:mod:`.dataset`): :class:`AsyncDataset` and its wrappers, :class:`StackedBatch`,
  :class:`ReadPlan`, :class:`DatasetExhausted`; token windows (:mod:`.text`): :class:`TokenSeqDataset`,
  :class:`CausalLmDataset`;
* the mixture (:mod:`.mixture`, index math in :mod:`.mixture_layout`): :class:`MixtureDataset`;
* the loader (:mod:`.loader`; read-ahead in :mod:`.read_ahead`, the prefetching thread in :mod:`.prefetch`,
  retries and the load error in :mod:`.load_errors`): :class:`DataLoader`, :class:`Batch`,
  :class:`DataLoadError`;
* configs (:mod:`.config`), fingerprints (:mod:`.fingerprint`), the schedule record
  (:mod:`.schedule_record`), and seeds and permutations (``seed_from_key``, ``derive_seed``,
  ``FeistelPermutation``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from levanter.utils.lazy_exports import lazy_exports

_EXPORTS = {
    "dataset": (
        "AsyncDataset", "BatchMappedAsyncDataset", "BlockShufflingDataset", "DatasetExhausted", "EpochDataset",
        "IndexMap", "ListAsyncDataset", "MappedAsyncDataset", "PermutationDataset", "ReadPlan", "SlicedAsyncDataset",
        "StackedBatch", "apply_index_maps", "as_index_array",
    ),
    "text": ("CausalLmDataset", "TokenSeqDataset", "causal_lm_columns", "causal_lm_columns_jax"),
    "mixture": ("STOP_STRATEGIES", "MixtureDataset", "largest_remainder_counts", "stage_schedule"),
    "mixture_layout": ("MixtureLayout",),
    "loader": (
        "PREFETCH_SWITCH_INTERVAL", "Batch", "DataLoader", "DataLoaderIterator", "process_rows", "rows_for_process",
        "use_prefetch_switch_interval",
    ),
    "load_errors": ("DataLoadError", "TransientDataError", "is_transient", "read_with_retries"),
    "prefetch": ("Prefetcher",),
    "read_ahead": ("ReadAhead",),
    "config": (
        "LMDatasetSourceConfig", "LMMixtureDatasetConfig", "LMTaskConfig", "TextLmDatasetFormat",
        "UrlSingleDatasetLMConfig",
    ),
    "fingerprint": ("batch_fingerprint", "fingerprint_arrays"),
    "schedule_record": ("data_schedule_record", "first_difference"),
    "_prp": ("FeistelPermutation", "derive_seed", "permute_many", "seed_from_key"),
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)



if TYPE_CHECKING:  # what static tools see: the same names, imported eagerly
    from ._prp import FeistelPermutation, derive_seed, permute_many, seed_from_key  # noqa: F401
    from .config import (  # noqa: F401
        LMDatasetSourceConfig,
        LMMixtureDatasetConfig,
        LMTaskConfig,
        TextLmDatasetFormat,
        UrlSingleDatasetLMConfig,
    )
    from .dataset import (  # noqa: F401
        AsyncDataset,
        BatchMappedAsyncDataset,
        BlockShufflingDataset,
        DatasetExhausted,
        EpochDataset,
        IndexMap,
        ListAsyncDataset,
        MappedAsyncDataset,
        PermutationDataset,
        ReadPlan,
        SlicedAsyncDataset,
        StackedBatch,
        apply_index_maps,
        as_index_array,
    )
    from .fingerprint import batch_fingerprint, fingerprint_arrays  # noqa: F401
    from .load_errors import DataLoadError, TransientDataError, is_transient, read_with_retries  # noqa: F401
    from .loader import (  # noqa: F401
        PREFETCH_SWITCH_INTERVAL,
        Batch,
        DataLoader,
        DataLoaderIterator,
        process_rows,
        rows_for_process,
        use_prefetch_switch_interval,
    )
    from .mixture import STOP_STRATEGIES, MixtureDataset, largest_remainder_counts, stage_schedule  # noqa: F401
    from .mixture_layout import MixtureLayout  # noqa: F401
    from .prefetch import Prefetcher  # noqa: F401
    from .read_ahead import ReadAhead  # noqa: F401
    from .schedule_record import data_schedule_record, first_difference  # noqa: F401
    from .text import CausalLmDataset, TokenSeqDataset, causal_lm_columns, causal_lm_columns_jax  # noqa: F401
