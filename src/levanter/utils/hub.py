"""Whether the Hugging Face hub may be used, and where it is: one reading of ``HF_HUB_OFFLINE`` and
``HF_ENDPOINT`` for every module that resolves hub ids (datasets, tokenizers, checkpoints).

An offline flag is read exactly as ``huggingface_hub`` reads it (``1``, ``on``, ``yes`` or ``true``, in any
case; ``HF_HUB_OFFLINE``, else ``TRANSFORMERS_OFFLINE`` when the first is unset or empty), so our fast
failure ("the hub is unavailable: HF_HUB_OFFLINE is set") happens exactly when the hub client itself would
refuse to connect. Dataset lookups also honour ``HF_DATASETS_OFFLINE``, which the ``datasets`` library adds.

Trade-off: the environment is read on every call rather than once at import, so a test (or a caller) that
sets a variable later is seen; the cost is a few dictionary lookups per hub resolution.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

# The values huggingface_hub takes as true (compared upper-cased).
_TRUE = frozenset({"1", "ON", "YES", "TRUE"})
DEFAULT_ENDPOINT = "https://huggingface.co"


def _is_true(value: str | None) -> bool:
    return value is not None and value.upper() in _TRUE


def offline_variable(*, datasets: bool = False) -> str | None:
    """The environment variable that puts the hub offline (for a message: ``"HF_HUB_OFFLINE is set"``), or
    None when it is online. With ``datasets``, ``HF_DATASETS_OFFLINE`` counts too."""
    hub = os.environ.get("HF_HUB_OFFLINE")
    name = "HF_HUB_OFFLINE" if hub else "TRANSFORMERS_OFFLINE"
    if _is_true(hub or os.environ.get("TRANSFORMERS_OFFLINE")):
        return name
    if datasets and _is_true(os.environ.get("HF_DATASETS_OFFLINE")):
        return "HF_DATASETS_OFFLINE"
    return None


def hub_offline(*, datasets: bool = False) -> bool:
    """Whether the environment puts the Hugging Face hub offline (see :func:`offline_variable`)."""
    return offline_variable(datasets=datasets) is not None


def hub_endpoint() -> str:
    """The hub's URL: ``HF_ENDPOINT``, else ``https://huggingface.co``."""
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT)


def hub_host() -> str:
    """The host name of :func:`hub_endpoint` (``huggingface.co`` when it has none)."""
    return urlparse(hub_endpoint()).hostname or "huggingface.co"


def hub_unreachable() -> str | None:
    """Why the hub cannot be reached (its host does not resolve), or None when it resolves: a DNS lookup
    answers in milliseconds where the hub client would retry HTTP for tens of seconds."""
    host = hub_host()
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        return f"the Hugging Face hub ({host}) is unreachable ({e})"
    return None


__all__ = ["DEFAULT_ENDPOINT", "hub_endpoint", "hub_host", "hub_offline", "hub_unreachable", "offline_variable"]
