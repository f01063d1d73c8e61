"""Optimizers: the ``optimizer:`` configs and learning-rate schedules (:mod:`.config`), and skipping an update
whose loss or gradient norm spikes (:mod:`.skip_steps`), and the averaged copy of the weights
(``trainer.model_averaging``, :mod:`.model_averaging`)."""

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(__name__, __package__, ("config", "model_averaging", "skip_steps"))
