"""Training data: step-indexed datasets, the mixture, the loader, and the data configs.

The doors of the package (everything a caller outside it needs): the names in each module's ``__all__``,
imported on first use (a lazy :func:`~levanter.utils.facade.facade`) so that importing ``levanter.data`` stays
cheap and no part of it imports another through this file:

* datasets (:mod:`.dataset`): :class:`AsyncDataset` and its wrappers; what a read is made of
  (:mod:`.read_plan`): :class:`StackedBatch`, :class:`ReadPlan`, :class:`DatasetExhausted`; token windows (:mod:`.text`): :class:`TokenSeqDataset`,
  :class:`CausalLmDataset`;
* the mixture (:mod:`.mixture`, index math in :mod:`.mixture_layout`, weights and stop strategies checked
  in :mod:`.mixture_weights`): :class:`MixtureDataset`;
* the data plan (:mod:`.planner`): what a config resolves to, stage by stage; tag checks (:mod:`.tags`);
* the loader (:mod:`.loader`; read-ahead in :mod:`.read_ahead`, the prefetching thread in :mod:`.prefetch`,
  retries and the load error in :mod:`.load_errors`): :class:`DataLoader`, :class:`Batch`,
  :class:`DataLoadError`;
* configs (:mod:`.config`; a source's section in :mod:`.source_config`), fingerprints (:mod:`.fingerprint`), the schedule record
  (:mod:`.schedule_record`), and seeds and permutations (``seed_from_key``, ``derive_seed``,
  ``FeistelPermutation``).
"""

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(
    __name__,
    __package__,
    (
        "read_plan",
        "dataset",
        "text",
        "mixture",
        "mixture_layout",
        "mixture_weights",
        "loader",
        "load_errors",
        "prefetch",
        "read_ahead",
        "source_config",
        "config",
        "planner",
        "fingerprint",
        "schedule_record",
        "tags",
        "_prp",
    ),
    lazy=True,
)
