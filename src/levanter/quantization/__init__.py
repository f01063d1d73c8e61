"""``trainer.quantization``: int8 or fp8 training of the linear layers. The section, applying it to a model
and the fp8 state's record in checkpoints (:mod:`.config`); the int8 kernel and where on a TPU its products
pay (:mod:`.int8`)."""

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(__name__, __package__, ("config", "int8"))
