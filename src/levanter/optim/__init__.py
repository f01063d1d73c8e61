"""Optimizers: the ``optimizer:`` configs and learning-rate schedules (:mod:`.config`), and skipping an update
whose loss or gradient norm spikes (:mod:`.skip_steps`); Sophia-H (:mod:`.sophia`) and Muon (:mod:`.muon`)."""

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(__name__, __package__, ("config", "skip_steps", "sophia", "muon"))
