"""Hugging Face datasets as cache sources: a dataset ``id`` resolved, through the ``datasets`` library, to
the data files of one split.

A source with ``id`` (upstream's keys: ``id``, ``name``, ``train_split``, ``validation_split``) becomes
the ordered list of files that hold the split; the cache builder then treats them as shards like any
``train_urls`` (one shard per file, so a build parallelises over them, and the ledger records each file's
identity). ``id`` may be:

* a directory written by ``Dataset.save_to_disk`` (its Arrow files serve the train split) or
  ``DatasetDict.save_to_disk`` (one subdirectory per split), read from ``datasets.load_from_disk``'s
  ``cache_files``;
* a local directory (or files) of parquet / JSON-lines data, split by the ``datasets`` library's own
  file-name conventions (``load_dataset_builder(...).config.data_files``: ``train-*.parquet``,
  ``data/validation.jsonl``, ...);
* a dataset on the Hugging Face hub, when the hub is reachable: its split's files are resolved the same
  way and downloaded into the Hugging Face cache (``HF_HOME``) before tokenizing. Without network (or
  with ``HF_HUB_OFFLINE=1``) this fails at once with one error naming the id, instead of the library's
  retries.

Formats: Arrow, parquet and JSON lines, read by :mod:`levanter.ingest.sources` (so a dataset gives the
same tokens as the same texts in jsonl). Text and CSV files are refused: ``datasets`` reads a text file
as one row per line, which a plain ``.txt`` shard here is not.

``datasets`` (and ``huggingface_hub``) are optional dependencies (``pip install 'levanter[hf]'``),
imported only when a source has an ``id``. Resolutions are memoised per process: configs ask for a
source's files several times (checking inputs, building, serving).
"""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import unquote, urlparse

from ..utils.hub import hub_endpoint, offline_variable
from .errors import SourceError
from .sources import detect_format

__all__ = ["hf_data_files"]

_HUB_PROBE_TIMEOUT_S = 5.0


def _import_datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise SourceError(
            f"{what}.id: Hugging Face datasets need the datasets library, which is not installed; install it "
            "with pip install 'levanter[hf]'"
        ) from None
    return datasets


def hf_data_files(
    id: str, name: str | None, split: str, *, what: str = "data", required: bool = True
) -> list[str]:
    """The data files of split ``split`` of dataset ``id`` (config ``name``), in the dataset's order.

    A split the dataset does not have is an error naming the splits it has when ``required``, else
    ``[]`` (a missing validation split means no validation set). ``what`` names the source's config key.
    """
    return list(_resolve(id, name, split, what, required))


@functools.lru_cache(maxsize=None)
def _resolve(id: str, name: str | None, split: str, what: str, required: bool) -> tuple[str, ...]:
    if os.path.isdir(id):
        files = _saved_dataset_files(id, split, what, required)
        if files is None:
            files = _builder_files(id, name, split, what, required)
    else:
        _check_hub_reachable(id, what)
        files = _download(_builder_files(id, name, split, what, required), id, what)
    for f in files:
        if detect_format(f) not in ("jsonl", "parquet", "arrow"):
            raise SourceError(
                f"{what}.id={id!r}: {f}: only parquet, JSON-lines and Arrow data files can be cached from a "
                "Hugging Face dataset (datasets reads text and CSV files differently); convert the split "
                "to parquet or JSON lines"
            )
    return tuple(files)


def _missing_split(id: str, split: str, have: list[str], what: str, required: bool):
    if not required:
        return []
    raise SourceError(
        f"{what}.id={id!r} has no split {split!r} (the split is chosen by {what}.train_split); its splits: "
        f"{sorted(have) or 'none'}"
    )


def _saved_dataset_files(path: str, split: str, what: str, required: bool) -> list[str] | None:
    """Files of a ``save_to_disk`` directory (None: ``path`` is not one)."""
    is_dict = os.path.exists(os.path.join(path, "dataset_dict.json"))
    if not is_dict and not os.path.exists(os.path.join(path, "state.json")):
        return None
    datasets = _import_datasets(what)
    try:
        loaded = datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001 -- datasets raises several types for damaged directories
        raise SourceError(
            f"{what}.id={path!r}: cannot load the saved dataset ({type(e).__name__}: {e})"
        ) from None
    if is_dict:
        if split not in loaded:
            return _missing_split(path, split, list(loaded), what, required)
        loaded = loaded[split]
    elif split != "train":
        # A saved Dataset has no splits: it is the training data.
        return _missing_split(path, split, ["train"], what, required)
    return [c["filename"] for c in loaded.cache_files]


def _builder_files(id: str, name: str | None, split: str, what: str, required: bool) -> list[str]:
    datasets = _import_datasets(what)
    try:
        builder = datasets.load_dataset_builder(id, name)
    except Exception as e:  # noqa: BLE001 -- missing dataset, bad config name, unreadable files...
        raise SourceError(f"{what}.id={id!r}: cannot resolve the dataset ({type(e).__name__}: {e})") from None
    data_files = builder.config.data_files or {}
    by_split = {str(k): list(v) for k, v in data_files.items()}
    if split not in by_split:
        return _missing_split(id, split, list(by_split), what, required)
    return by_split[split]


def _check_hub_reachable(id: str, what: str) -> None:
    """Fail at once when the hub cannot be reached (the library would retry for tens of seconds)."""
    offline = offline_variable(datasets=True)
    why = f"{offline} is set" if offline else None
    if why is None:
        url = urlparse(hub_endpoint())
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            socket.create_connection((url.hostname, port), timeout=_HUB_PROBE_TIMEOUT_S).close()
        except OSError as e:
            why = f"{url.hostname}:{port} cannot be reached ({e.strerror or e})"
    if why is not None:
        raise SourceError(
            f"{what}.id={id!r} is not a local directory, and the Hugging Face hub is unavailable: {why}. "
            f"Run where the hub is reachable, or download the dataset (e.g. Dataset.save_to_disk, or its "
            f"parquet files) and set {what}.id to that directory or {what}.train_urls to the files."
        )


def _download(files: list[str], id: str, what: str) -> list[str]:
    """Local copies (in the Hugging Face cache) of the ``hf://datasets/...`` files of a hub dataset."""
    from huggingface_hub import hf_hub_download

    out = []
    for f in files:
        if not f.startswith("hf://datasets/"):
            out.append(f)
            continue
        parts = f[len("hf://datasets/"):].split("/")
        # hf://datasets/[owner/]name[@revision]/path: an owner-less repository has the revision in part 0.
        n = 1 if "@" in parts[0] or len(parts) < 3 else 2
        repo, _, revision = "/".join(parts[:n]).partition("@")
        path = "/".join(parts[n:])
        revision = unquote(revision) or None
        try:
            out.append(hf_hub_download(repo, path, repo_type="dataset", revision=revision))
        except Exception as e:  # noqa: BLE001 -- network and hub errors
            raise SourceError(f"{what}.id={id!r}: cannot download {f} ({type(e).__name__}: {e})") from None
    return out
