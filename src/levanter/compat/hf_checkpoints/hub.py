"""Where a Hugging Face checkpoint is: a local directory, an object-store URL, or a hub id.

A hub id (``org/name``) is downloaded with ``huggingface_hub`` into its cache when the hub is reachable.
Offline (``HF_HUB_OFFLINE`` set, or the hub's host does not resolve) it fails in milliseconds with one
paragraph, after looking in the local hub cache, instead of the library's minutes of retries. The DNS
lookup is a cheap probe that can be wrong both ways (a proxy that resolves but blocks); it only decides
whether the download is tried at all, and the download's own error is reported either way.
"""

from __future__ import annotations

import os
from levanter.utils import fs
from levanter.utils.hub import hub_unreachable, offline_variable

from .safetensors_io import CONFIG_FILE, SAFE_INDEX, TOKENIZER_FILES

__all__ = ["could_be_hub_id", "resolve_hf_checkpoint"]


def could_be_hub_id(spec: str) -> bool:
    """Whether ``spec`` is shaped like a hub id (``gpt2`` or ``org/name``) rather than a path or URL."""
    if spec.startswith(("/", ".", "~")) or "\\" in spec or "://" in spec:
        return False
    return spec.count("/") <= 1 and all(spec.split("/"))


def resolve_hf_checkpoint(path_or_id: str, *, what: str = "checkpoint") -> str:
    """The directory (local path or URL) holding the checkpoint ``path_or_id``: a local directory or
    object-store URL as is; a hub id downloaded into the hub cache (``config.json``, safetensors and
    tokenizer files). ``ValueError`` (one paragraph) when it does not exist or the hub is unreachable."""
    if not isinstance(path_or_id, str) or not path_or_id.strip():
        raise ValueError(f"Hugging Face {what} must be a non-empty path or hub id, got {path_or_id!r}")
    spec = path_or_id.strip()
    if fs.is_url(spec):
        if not fs.exists(fs.join(spec, CONFIG_FILE)):
            raise ValueError(f"Hugging Face {what} {spec!r} has no {CONFIG_FILE}")
        return fs.abspath(spec)
    local = os.path.expanduser(spec[len("file://"):] if spec.startswith("file://") else spec)
    if os.path.exists(local):
        if not os.path.isdir(local):
            raise ValueError(f"Hugging Face {what} {spec!r} is a file; pass the directory that holds {CONFIG_FILE}")
        if not os.path.isfile(os.path.join(local, CONFIG_FILE)):
            raise ValueError(f"Hugging Face {what} directory {spec!r} has no {CONFIG_FILE}")
        return os.path.abspath(local)
    if not could_be_hub_id(spec):
        raise ValueError(
            f"Hugging Face {what} {spec!r} does not exist (resolved to {os.path.abspath(local)!r}); pass a "
            f"directory holding {CONFIG_FILE} and *.safetensors, or a hub id such as 'org/name'"
        )
    return _download(spec, what)


def _download(repo_id: str, what: str) -> str:
    from huggingface_hub import snapshot_download

    # A tokenizer needs its own files only, never a model's weights.
    patterns = list(TOKENIZER_FILES) if what == "tokenizer" else [CONFIG_FILE, "*.safetensors", SAFE_INDEX, *TOKENIZER_FILES]
    offline_by = offline_variable()  # the environment's one reading (levanter.utils.hub), shared with ingest
    offline = offline_by is not None
    why = None if offline else hub_unreachable()
    try:
        # Unreachable: the hub cache may still hold it (no network call with local_files_only).
        return snapshot_download(repo_id, allow_patterns=patterns, local_files_only=why is not None or offline)
    except Exception as e:  # noqa: BLE001 -- every hub failure becomes the one paragraph below
        reason = why or (f"{offline_by} is set" if offline else f"{type(e).__name__}: {_first_line(e)}")
        raise ValueError(
            f"Hugging Face {what} {repo_id!r} is not a local directory, and it could not be downloaded from the "
            f"hub: {reason}; it is not in the local hub cache either. Offline, pass a local directory holding "
            f"{CONFIG_FILE} and *.safetensors instead (python -c \"import transformers; "
            f"transformers.AutoModelForCausalLM.from_pretrained('{repo_id}').save_pretrained('DIR')\" on a "
            "machine with network makes one)."
        ) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
