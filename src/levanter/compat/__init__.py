"""Compatibility with other ecosystems' checkpoint formats: Hugging Face ``transformers`` directories
(:mod:`levanter.compat.hf_checkpoints`). The public names are listed once, in that module's ``__all__``."""

from levanter.compat.hf_checkpoints import *  # noqa: F401,F403
from levanter.compat.hf_checkpoints import __all__  # noqa: F401
