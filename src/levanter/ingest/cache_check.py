"""Whether a token cache matches what a run asks for: the settings it was built with and its input files.

A cache records everything that determines its content (:func:`cache_metadata`: the tokenizer, text key,
EOS, URLs, a chat format) and, per input file, its identity
(:func:`~levanter.ingest.identity.file_identity`: size, modification and status-change times, inode, a
hash of the whole content). A cache built with other settings is refused (:class:`CacheMismatchError`),
never silently reused; before a finished cache is served (:func:`verify_inputs`), or an interrupted build
resumed (:func:`resume_mismatch`), the configured URLs are expanded again and compared, so a file that was
edited, added to a glob or removed is named in one error.

Trade-off: a cache is tied to the paths of its inputs, not their content alone (the ledger counts
documents per shard file), so the same files moved elsewhere are another cache.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..errors import is_out_of_space, out_of_space_error
from ..store.ledger import CacheLedger
from ..utils import fs
from .chat import ChatSpec
from .embedded import corpus_fingerprint, is_embedded_url, parse_embedded_url
from .identity import file_identity, identity_change, is_partial
from .sources import expand_urls

__all__ = [
    "CACHE_FORMAT",
    "CacheMismatchError",
    "cache_metadata",
    "check_metadata",
    "check_writable",
    "describe_items",
    "input_identities",
    "resume_mismatch",
    "verify_inputs",
]

logger = logging.getLogger(__name__)

CACHE_FORMAT = "levanter-token-cache-v1"


class CacheMismatchError(ValueError):
    """A cache exists at the path but was built with other settings."""


def cache_metadata(
    tokenizer, *, urls: Sequence[str], text_key: str, enforce_eos: bool, chat: ChatSpec | None = None
) -> dict:
    """Everything that determines a cache's content, compared before reuse.

    A chat cache (``chat``: :class:`~levanter.ingest.chat.ChatSpec`) records it under ``"chat"``; a text
    cache has no such key, so neither is ever reused as the other (and text caches are as they always were).

    Inputs are recorded as the configured URLs (plus a fingerprint of each embedded source, whose text
    depends on the Python version), so a finished cache serves training even where the raw files are
    gone; the expanded shard list is kept under ``"shards"`` and each file's identity under ``"inputs"``,
    both checked separately (:func:`verify_inputs`, and when an interrupted build resumes).
    """
    eos = tokenizer.eos_token_id if enforce_eos else None
    if enforce_eos and eos is None:
        raise ValueError(
            f"enforce_eos is true but the tokenizer {tokenizer.name!r} has no EOS token to append; set "
            "data.enforce_eos: false (pre-tokenized data usually carries its own separators)"
        )
    embedded = {u: corpus_fingerprint(parse_embedded_url(u)[0]) for u in urls if is_embedded_url(u)}
    return {
        "format": CACHE_FORMAT,
        "tokenizer": tokenizer.fingerprint(),
        "vocab_size": int(tokenizer.vocab_size),
        "eos_id": tokenizer.eos_token_id,
        "enforce_eos": bool(enforce_eos),
        "text_key": text_key,
        "urls": list(urls),
        "embedded": embedded,
        **({"chat": chat.record()} if chat is not None else {}),
    }


def check_metadata(cache_dir: str, found: dict, wanted: dict) -> None:
    keys = (set(found) | set(wanted)) - {"shards", "inputs"}
    diffs = [k for k in sorted(keys) if found.get(k) != wanted.get(k)]
    if diffs:
        pairs = [(k, *_differing(found.get(k), wanted.get(k))) for k in diffs]
        detail = "; ".join(f"{k}: cache has {a!r}, config asks for {b!r}" for k, a, b in pairs)
        moved = ""
        if "urls" in diffs:
            # Resume and reuse go by input path (the ledger counts documents per shard file): the same
            # content under other paths, or cut into other shards, is another cache.
            moved = (" A cache is tied to the paths of its input files: inputs moved (to a bucket, another "
                     "directory) or re-split into other shards are not reused or resumed even when their "
                     "content is the same; point the URLs back at the original files to reuse it.")
        raise CacheMismatchError(
            f"the cache at {cache_dir!r} was built with different settings ({detail}).{moved} Use another "
            "cache_dir, or delete this one to rebuild it."
        )


def _differing(a, b):
    """``(a, b)``, or for two mappings only their differing entries (a content hash only if nothing else
    differs)."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return a, b
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if len(keys) > 1 and "hash" in keys:
        keys.remove("hash")
    return {k: a.get(k) for k in keys}, {k: b.get(k) for k in keys}


def _file_inputs(urls: Sequence[str], what: str) -> list[str]:
    """The files the non-embedded ``urls`` name now (missing files and empty globs skipped)."""
    return expand_urls([u for u in urls if not u.startswith("embedded://")], what=what, allow_empty=True,
                       missing_ok=True)


def input_identities(urls: Sequence[str], shards: Sequence[str], what: str) -> dict:
    files = set(_file_inputs(urls, what))
    return {sh: file_identity(sh) for sh in shards if sh in files}


def describe_items(items: list[str], limit: int = 3) -> str:
    shown = "; ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown}; and {len(items) - limit} more"


# Caches (absolute paths, or URLs) already warned about as recorded without input identities.
_warned_unchecked: set[str] = set()


def _refuse_partial(cache_dir: str, recorded: dict, paths: Sequence[str], what: str) -> None:
    partial = [p for p in paths if p in recorded and is_partial(recorded[p])]
    if partial:
        raise CacheMismatchError(
            f"the token cache at {cache_dir!r} records only a partial content hash (first and last MiB) of "
            f"{describe_items(partial)} ({what}), so an edit inside it cannot be detected: delete {cache_dir} to "
            "rebuild it (the rebuilt cache records a hash of the whole content)."
        )


def verify_inputs(
    cache_dir: str, ledger: CacheLedger, urls: Sequence[str], *, what: str = "train_urls", full: bool = False
) -> None:
    """Refuse (:class:`CacheMismatchError`) when the input files of the cache ``ledger`` describes differ
    from what ``urls`` name now: an edited file, a file added to or gone from the shard list.

    ``full`` hashes every local file (``cache_options.verify_inputs: full``); otherwise a file is hashed
    only when its metadata changed (:func:`~levanter.ingest.identity.identity_change`). Where none of the
    recorded files exists any more the cache is served unchecked (tokenized data needs no raw files); a
    cache recorded without identities gets a warning that it cannot be checked.
    """
    if "urls" in ledger.metadata:  # inputs moved to other paths: named as such, before their files
        check_metadata(cache_dir, {"urls": ledger.metadata["urls"]}, {"urls": list(urls)})
    recorded = ledger.metadata.get("inputs")
    if recorded is None:
        # Once per cache and process: a run (or a benchmark) opens the same cache many times, and the
        # warning says nothing new after the first.
        key = fs.abspath(cache_dir)
        if key not in _warned_unchecked:
            _warned_unchecked.add(key)
            logger.warning(
                "the token cache at %s records no identities of its input files (an older cache): it cannot "
                "be checked against %s; delete it to rebuild if the files changed", cache_dir, what,
            )
        return
    current = _file_inputs(urls, what)
    if not current and recorded:
        logger.info("none of the input files of the token cache at %s exist here; serving it unchecked",
                    cache_dir)
        return
    changes = [f"new file {p}" for p in current if p not in recorded]
    changes += [f"{p} is gone" for p in recorded if p not in current]
    if not changes:
        _refuse_partial(cache_dir, recorded, current, what)
    changes += [c for p in current if p in recorded and not is_partial(recorded[p])
                and (c := identity_change(p, recorded[p], full=full))]
    if changes:
        raise CacheMismatchError(
            f"the input files of {what} changed since the token cache at {cache_dir!r} was built: "
            f"{describe_items(changes)}. The cache holds the old data: delete {cache_dir} to rebuild it from the "
            "current files, or use another cache_dir."
        )


def check_writable(cache_dir: str, key: str = "cache_dir") -> None:
    """Fail before any tokenizing when ``cache_dir`` cannot be created or written; ``key`` names the config
    key in the message."""
    try:
        fs.probe_writable(cache_dir)
    except fs.StorageAccessError as e:
        raise fs.StorageAccessError(f"{key}: {e}; point {key} at a bucket and prefix this run can write") from None
    except OSError as e:
        if is_out_of_space(e):
            raise out_of_space_error("creating the token cache", cache_dir) from None
        raise ValueError(
            f"{key}: cannot write the token cache at {cache_dir} ({e.strerror or e}); point {key} at a "
            "writable directory"
        ) from None




def resume_mismatch(cache_dir: str, ledger: CacheLedger, shards: list[str], what: str, *,
                     full: bool) -> str | None:
    """How the inputs of an interrupted build differ from ``shards`` (None: they match)."""
    before = ledger.metadata.get("shards") or []
    if before != shards:
        changes = [f"new file {p}" for p in shards if p not in before]
        changes += [f"{p} is gone" for p in before if p not in shards]
        return describe_items(changes or [f"the shard order changed (was {before}, now {shards})"])
    recorded = ledger.metadata.get("inputs")
    if recorded is None:
        return None
    if ledger.total_tokens:
        _refuse_partial(cache_dir, recorded, shards, what)
    changes = [c for p, old in recorded.items() if p in shards and (c := identity_change(p, old, full=full))]
    return describe_items(changes) if changes else None
