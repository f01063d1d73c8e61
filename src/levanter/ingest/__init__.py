"""Ingest: from documents on disk to a finished token cache.

* :mod:`~levanter.ingest.sources`: URL expansion (globs, braces, fsspec) and per-format readers, with
  errors naming the file and line at fault.
* :mod:`~levanter.ingest.identity`: :func:`file_identity`, what a cache records per input file (metadata and
  a hash of the whole content), and how a change is detected (``cache_options.verify_inputs``).
* :mod:`~levanter.ingest.hf_sources`: Hugging Face datasets (local or on the hub) resolved to data files.
* :mod:`~levanter.ingest.tokenization`: byte, Hugging Face and passthrough tokenizers behind one interface.
* :mod:`~levanter.ingest.chat`: chat-formatted documents (lists of messages) rendered by a chat template into
  token ids and the mask of the assistant tokens to train on.
* :mod:`~levanter.ingest.embedded`: the embedded default corpus (Python's own docs and code).
* :mod:`~levanter.ingest.tokenize_worker`: the tokenizer side of a build, run in pool workers.
* :mod:`~levanter.ingest.build`: :func:`build_or_load_cache`, which tokenizes documents into a
  :class:`~levanter.store.cache.TokenCache` and resumes interrupted builds;
  :mod:`~levanter.ingest.cache_check` refuses caches whose settings or input files changed;
  :mod:`~levanter.ingest.cache_options` is the ``cache_options`` section;
  :mod:`~levanter.ingest.encoders` decides who tokenizes a batch (this process, a process pool, or Ray
  through :mod:`~levanter.ingest.ray_backend`) and :mod:`~levanter.ingest.progress` reports progress.

Ingest sits above :mod:`levanter.store` (it writes caches through it) and below :mod:`levanter.data`
(which builds caches from configs and reads them). Names are loaded on first use: tokenizer pool
workers import this package to run :mod:`~levanter.ingest.tokenize_worker`, and must not pay for
tensorstore, which only the builder needs.
"""

from __future__ import annotations

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(
    __name__,
    __package__,
    (
        "build",
        "cache_check",
        "cache_options",
        "chat",
        "embedded",
        "encoders",
        "errors",
        "identity",
        "hf_sources",
        "sources",
        "tokenization",
    ),
    lazy=True,
)
