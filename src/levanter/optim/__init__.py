"""Optimizers: the ``optimizer:`` configs and learning-rate schedules (:mod:`.config`), skipping an update
whose loss or gradient norm spikes (:mod:`.skip_steps`), Sophia-H (:mod:`.sophia`) and Muon (:mod:`.muon`),
and the averaged copy of the weights (``trainer.model_averaging``, :mod:`.model_averaging`)."""

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(
    __name__, __package__, ("config", "model_averaging", "skip_steps", "sophia", "muon")
)
