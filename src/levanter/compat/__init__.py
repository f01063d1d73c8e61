"""Compatibility with other ecosystems' checkpoint formats: Hugging Face ``transformers`` directories
(:mod:`levanter.compat.hf_checkpoints`). The public names are listed once, in that module's ``__all__``."""

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(__name__, __package__, ("hf_checkpoints",))
