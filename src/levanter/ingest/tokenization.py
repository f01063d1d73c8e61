"""Tokenizers behind one small interface, so the cache builder and the trainer need not care which.

Three kinds:

* :class:`ByteTokenizer`: ids 0..255 are UTF-8 bytes, 256 is EOS. Needs nothing on disk, never
  fails to encode, and is the offline default; sequences are ~3-4x longer than with BPE.
* :class:`HfTokenizer`: a Hugging Face ``tokenizers`` tokenizer from a local ``tokenizer.json`` (or a
  hub name, when online). :func:`train_bpe` makes one from local text, e.g. the embedded corpus.
* :class:`PassthroughTokenizer`: the data is already token ids; it only carries ``vocab_size``.

:meth:`Tokenizer.encode_batch` never adds special tokens: where EOS/BOS go is the cache builder's
decision, made once, rather than a per-tokenizer post-processor setting.

:meth:`Tokenizer.fingerprint` is a JSON-able dict (``kind`` plus a content ``hash``) stored with a
token cache, so a cache built with one tokenizer is refused by a run using another. It hashes
content, not location: the same ``tokenizer.json`` loaded from two paths fingerprints the same.

:func:`load_tokenizer` maps a config string to a tokenizer: ``"byte"``, ``"passthrough"``, a local
path, or a hub name. Trade-off in telling paths from hub names: ``org/name`` hub ids look like
relative paths, so a string is a path when it exists; a missing one is reported as a missing path
only when it cannot be a hub id (it is absolute, starts with ``.`` or ``~``, ends in ``.json`` or
has more than one ``/``); otherwise the hub is tried and its failure names both readings.
"""

from __future__ import annotations

import abc
import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Sequence

import numpy as np

from ..utils.fs import atomic_write_text
from ..utils.hub import hub_offline, hub_unreachable

__all__ = [
    "ByteTokenizer",
    "HfTokenizer",
    "PassthroughTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "train_bpe",
]

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
BOS_CANDIDATES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>")
BPE_EOS = "<|endoftext|>"


def _hash_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


class Tokenizer(abc.ABC):
    """Text <-> token ids. Attributes are plain values so they can be logged and compared."""

    name: str
    vocab_size: int
    eos_token_id: int | None
    bos_token_id: int | None
    # The Jinja chat template the tokenizer ships with (tokenizer_config.json), if any.
    chat_template: str | None = None

    @property
    def backend(self):
        """The wrapped Hugging Face ``tokenizers.Tokenizer``; None for a tokenizer that has none."""
        return None

    @abc.abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids for each text, with no special tokens added."""

    def encode_batch_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, lengths)``: the token ids of all ``texts`` concatenated (int32) and one length per
        text (int64). Subclasses override it to skip per-token Python objects."""
        ids = self.encode_batch(texts)
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
        return flat, lengths

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text for ``ids``; special tokens appear in their text form (EOS as ``<|endoftext|>``)."""

    @abc.abstractmethod
    def fingerprint(self) -> dict:
        """JSON-able identity: ``{"kind": ..., "hash": ..., ...}``; equal iff the token ids would be."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, EOS = 256.

    ``vocab_size`` may exceed 257 to pad the embedding table to a friendly multiple (e.g. 320);
    ids above 256 are never produced and decode to nothing.
    """

    EOS_TEXT = "<|endoftext|>"

    def __init__(self, vocab_size: int = 257):
        if vocab_size < 257:
            raise ValueError(f"ByteTokenizer needs vocab_size >= 257 (256 bytes + EOS), got {vocab_size}")
        self.name = "byte"
        self.vocab_size = int(vocab_size)
        self.eos_token_id = 256
        self.bos_token_id = None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # "surrogatepass" keeps lone surrogates (possible in Python strings) encodable rather than
        # failing a whole cache build on one odd document; they decode back as U+FFFD.
        return [list(t.encode("utf-8", "surrogatepass")) for t in texts]

    def encode_batch_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        encoded = [t.encode("utf-8", "surrogatepass") for t in texts]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        return np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.int32), lengths

    def decode(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                buf.append(i)
            elif i == self.eos_token_id:
                out.append(buf.decode("utf-8", "replace"))
                buf.clear()
                out.append(self.EOS_TEXT)
        out.append(buf.decode("utf-8", "replace"))
        return "".join(out)

    def fingerprint(self) -> dict:
        spec = {"kind": "byte", "vocab_size": self.vocab_size, "eos_token_id": self.eos_token_id}
        return {**spec, "hash": _hash_json(spec)}


class PassthroughTokenizer(Tokenizer):
    """For data that is already token ids: carries ``vocab_size`` (and optionally EOS), encodes nothing."""

    def __init__(self, vocab_size: int, eos_token_id: int | None = None, bos_token_id: int | None = None):
        if vocab_size is None or int(vocab_size) <= 0:
            raise ValueError(f"PassthroughTokenizer needs a positive vocab_size, got {vocab_size!r}")
        self.name = "passthrough"
        self.vocab_size = int(vocab_size)
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        raise TypeError(
            "PassthroughTokenizer cannot encode text: it is for pre-tokenized data, whose token ids "
            "the cache builder reads directly. Use tokenizer 'byte', a local tokenizer.json, or a hub "
            "name to tokenize text."
        )

    def decode(self, ids: Sequence[int]) -> str:
        # No vocabulary to decode with; the ids themselves are the most useful text for debugging.
        return " ".join(str(int(i)) for i in ids)

    def fingerprint(self) -> dict:
        spec = {
            "kind": "passthrough",
            "vocab_size": self.vocab_size,
            "eos_token_id": self.eos_token_id,
            "bos_token_id": self.bos_token_id,
        }
        return {**spec, "hash": _hash_json(spec)}


def _special_content(value) -> str | None:
    # tokenizer_config.json writes special tokens either as a string or as {"content": ...}.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class HfTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer``. Build with :meth:`from_path`, :meth:`from_hub` or :func:`train_bpe`.

    EOS/BOS come from ``tokenizer_config.json`` next to ``tokenizer.json`` when it names them, else
    from the first common special token present in the vocabulary.
    """

    def __init__(self, tok, *, name: str, content_hash: str, config: dict | None = None):
        self._tok = tok
        self.name = name
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        self._content_hash = content_hash
        config = config or {}
        self.eos_token_id = self._resolve(config.get("eos_token"), EOS_CANDIDATES)
        self.bos_token_id = self._resolve(config.get("bos_token"), BOS_CANDIDATES)
        # The Jinja chat template of tokenizer_config.json, for chat-formatted data (levanter.ingest.chat).
        template = config.get("chat_template")
        self.chat_template = template if isinstance(template, str) else None

    def _resolve(self, configured, candidates: Sequence[str]) -> int | None:
        content = _special_content(configured)
        if content is not None:
            tid = self._tok.token_to_id(content)
            if tid is not None:
                return int(tid)
        for cand in candidates:
            tid = self._tok.token_to_id(cand)
            if tid is not None:
                return int(tid)
        return None

    @classmethod
    def from_path(cls, path: str) -> "HfTokenizer":
        """Load from a directory containing ``tokenizer.json`` or from the ``tokenizer.json`` file."""
        from tokenizers import Tokenizer as _HfTokenizer

        path = os.path.expanduser(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ValueError(
                f"tokenizer path {path!r} has no tokenizer.json"
                if os.path.isdir(path)
                else f"tokenizer file {path!r} does not exist"
            )
        with open(file, "rb") as f:
            raw = f.read()
        try:
            tok = _HfTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:
            raise ValueError(f"could not load tokenizer from {file!r}: {e}") from e
        config = {}
        config_file = os.path.join(os.path.dirname(file), "tokenizer_config.json")
        if os.path.isfile(config_file):
            try:
                with open(config_file) as f:
                    config = json.load(f)
            except (OSError, ValueError):
                config = {}  # a broken optional file should not block loading; fall back to candidates
        # The file's bytes, not the path: the same tokenizer copied elsewhere must match a cache.
        return cls(tok, name=path, content_hash=hashlib.sha256(raw).hexdigest(), config=config)

    @classmethod
    def from_hub(cls, name: str) -> "HfTokenizer":
        from tokenizers import Tokenizer as _HfTokenizer

        _check_hub_reachable(name)
        try:
            tok = _HfTokenizer.from_pretrained(name)
        except Exception as e:
            raise ValueError(
                f"could not load tokenizer {name!r}: it is not an existing local path, and loading it "
                f"from the Hugging Face hub failed ({type(e).__name__}: {e}). Offline, pass a local "
                "directory or tokenizer.json path instead, or use 'byte' (no files needed) or "
                "'passthrough' (pre-tokenized data). Set HF_HUB_OFFLINE=1 to fail fast without network."
            ) from e
        # Hub loads give no file bytes; the canonical serialisation stands in for them.
        return cls(tok, name=name, content_hash=hashlib.sha256(tok.to_str().encode()).hexdigest())

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # encode_batch_fast skips offset tracking, which the cache builder never uses.
        encs = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [e.ids for e in encs]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def fingerprint(self) -> dict:
        return {
            "kind": "hf",
            "hash": self._content_hash,
            "vocab_size": self.vocab_size,
            "eos_token_id": self.eos_token_id,
            "bos_token_id": self.bos_token_id,
        }

    @property
    def backend(self):
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tok


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str) -> HfTokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenisation, ``<|endoftext|>`` as EOS) on ``texts``.

    Saves ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir`` and returns the loaded
    tokenizer. The same texts give a byte-identical ``tokenizer.json``.
    """
    from tokenizers import Tokenizer as _HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(
            f"byte-level BPE needs vocab_size >= {len(alphabet) + 1} (256 byte symbols + EOS), "
            f"got {vocab_size}"
        )
    tok = _HfTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        # Seeding all 256 byte symbols means any text encodes, even bytes absent from `texts`.
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_text(os.path.join(out_dir, "tokenizer.json"), tok.to_str(pretty=True))
    atomic_write_text(
        os.path.join(out_dir, "tokenizer_config.json"),
        json.dumps({"eos_token": BPE_EOS, "bos_token": None}, indent=2) + "\n",
    )
    return HfTokenizer.from_path(out_dir)


def _check_hub_reachable(name: str) -> None:
    """Fail in milliseconds, not after ~20 s of HTTP retries, when the hub's host does not resolve."""
    if hub_offline():
        return  # the hub client itself fails fast in offline mode
    why = hub_unreachable()
    if why is not None:
        raise ValueError(
            f"could not load tokenizer {name!r}: it is not an existing local path, and {why}. Offline, pass a "
            "local directory or tokenizer.json path instead, or use 'byte' (no files needed) or 'passthrough' "
            "(pre-tokenized data)."
        )


def _could_be_hub_id(spec: str) -> bool:
    if spec.startswith(("/", ".", "~")) or spec.endswith(".json") or "\\" in spec:
        return False
    if os.sep != "/" and os.sep in spec:
        return False
    return spec.count("/") <= 1 and bool(spec.strip("/"))


def load_tokenizer(spec: str, *, vocab_size: int | None = None) -> Tokenizer:
    """Build a tokenizer from a config string.

    * ``"byte"`` -> :class:`ByteTokenizer` (``vocab_size``, if given, pads it: must be >= 257);
    * ``"passthrough"`` -> :class:`PassthroughTokenizer` (``vocab_size`` required);
    * an existing directory or ``tokenizer.json`` path -> :class:`HfTokenizer`;
    * a missing path that cannot be a hub id -> ``ValueError`` naming the path;
    * otherwise a hub name (``ValueError`` with offline alternatives when that fails).

    For hub/path tokenizers ``vocab_size``, if given, must be at least the tokenizer's own.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"tokenizer must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec == "byte":
        return ByteTokenizer(257 if vocab_size is None else vocab_size)
    if spec == "passthrough":
        if vocab_size is None:
            raise ValueError(
                "tokenizer 'passthrough' (pre-tokenized data) needs vocab_size: the token ids carry no "
                "vocabulary, so set vocab_size to the size of the id space"
            )
        return PassthroughTokenizer(vocab_size)

    path = os.path.expanduser(spec)
    if os.path.exists(path):
        tok: Tokenizer = HfTokenizer.from_path(path)
    elif not _could_be_hub_id(spec):
        raise ValueError(
            f"tokenizer path {spec!r} does not exist (resolved to {os.path.abspath(path)!r}); pass an "
            "existing directory containing tokenizer.json or a tokenizer.json file, or use 'byte' or "
            "'passthrough'"
        )
    else:
        tok = HfTokenizer.from_hub(spec)
    if vocab_size is not None and vocab_size < tok.vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than tokenizer {spec!r}'s vocabulary ({tok.vocab_size})"
        )
    return tok
