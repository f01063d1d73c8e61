"""The registry of model families that Hugging Face import and export know.

How to add a family (say ``mistral``):

1. Write ``hf_checkpoints/mistral.py`` that builds one :class:`HfFamily` and calls
   :func:`register_family` on it at import time. It gives: our config class and ``model.type`` name, the
   ``config.json`` ``model_type`` values it reads, ``from_hf`` (a ``config.json`` dict -> ``(our config,
   vocab_size)``, refusing with ``ValueError`` every field whose value we do not implement, naming it),
   ``to_hf`` (our config -> the ``config.json`` dict, refusing what the Hugging Face class cannot express),
   ``layout`` (our parameter path -> Hugging Face tensor name and axes, see below) and ``shape_fields``
   (the config fields that describe the weights; ``initialize_from_hf`` takes them from the checkpoint).
   :func:`hf_int` and :func:`hf_field` read fields with errors that name them.
2. Add its module name to ``FAMILY_MODULES`` below (the one registration line).

A layout maps each parameter path of our model (``layers.stacked.self_attn.q_proj.weight``) to the
Hugging Face tensor name (``model.layers.{i}.self_attn.q_proj.weight``; ``{i}`` marks a per-layer tensor,
stacked along our ``layers`` axis, and ``{e}`` a per-expert one, stacked along ``experts``) and the Hugging Face tensor's axes as groups of our axis names
(``(("heads", "head_size"), ("embed",))``: a torch ``Linear`` weight is ``[out, in]``). One table drives
both directions (:mod:`.weights`), so import and export are exact inverses; a parameter missing from the
table is an error, never a silently dropped tensor.

Family modules are imported on the first lookup rather than when this module loads: they import model
classes and this registry, and loading them lazily keeps that cycle out of import order.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional

from levanter.models import LmConfig

__all__ = [
    "FAMILY_MODULES",
    "L",
    "E",
    "STACKED",
    "Layout",
    "HfFamily",
    "register_family",
    "families",
    "family_of",
    "family_name",
    "family_for_model_type",
    "hf_config_to_lm",
    "lm_to_hf_config",
    "SHAPE_FIELDS",
    "hf_field",
    "hf_int",
    "refuse_true",
]

# The family modules of this package, each of which registers one or more families when imported.
FAMILY_MODULES = ("gpt2", "llama", "qwen", "mistral", "mixtral", "gemma", "olmo")

L = "{i}"  # in a layout's tensor name: per-layer tensors, stacked along our `layers` axis
E = "{e}"  # in a layout's tensor name: per-expert tensors, stacked along our `experts` axis (after {i})
# Each index of a tensor name and the axis of ours its tensors are stacked along, outermost first.
STACKED = ((L, "layers"), (E, "experts"))

# Our parameter path -> (Hugging Face tensor name, Hugging Face axes as groups of our axis names).
Layout = dict[str, tuple[str, tuple[tuple[str, ...], ...]]]


@dataclasses.dataclass(frozen=True)
class HfFamily:
    """One architecture's mapping between our config and model and the Hugging Face ones."""

    # Our model.type name (the LmConfig registry's), used in messages and SHAPE_FIELDS.
    name: str
    # Our config class; a config is looked up by its exact type (a subclass is a family of its own).
    config_class: type
    # The config.json model_type values this family reads.
    model_types: tuple[str, ...]
    # config.json dict, where (for messages) -> (our config, vocab_size).
    from_hf: Callable[[dict, str], tuple[LmConfig, int]]
    # our config, vocab_size -> config.json dict.
    to_hf: Callable[[LmConfig, int], dict]
    # our config -> the weight layout of a model built from it.
    layout: Callable[[LmConfig], Layout]
    # The config fields that describe the weights (taken from config.json by initialize_from_hf).
    shape_fields: tuple[str, ...]
    # Prepended to every tensor name on export (GPT2LMHeadModel's "transformer.").
    export_prefix: str = ""
    # The prefix a checkpoint's tensor names carry, from the set of names (default: export_prefix).
    import_prefix: Optional[Callable[[set], str]] = None
    # Whether the output head is the embedding matrix (a stored lm_head.weight is then a redundant copy).
    head_is_tied: Callable[[LmConfig], bool] = lambda config: bool(config.tie_word_embeddings)  # Llama-style
    # Extra check of a run's merged config against the checkpoint's: (run config, checkpoint's, what) -> None.
    check_merge: Optional[Callable[[LmConfig, LmConfig, str], None]] = None

    def prefix_in(self, names: set) -> str:
        return self.import_prefix(names) if self.import_prefix is not None else self.export_prefix


_BY_NAME: dict[str, HfFamily] = {}
_BY_CLASS: dict[type, HfFamily] = {}
_BY_MODEL_TYPE: dict[str, HfFamily] = {}
_loaded = False


def register_family(family: HfFamily) -> HfFamily:
    """Add ``family`` to the registry (a second family with the same name, class or model_type is refused)."""
    clash = [k for k in family.model_types if k in _BY_MODEL_TYPE]
    if family.name in _BY_NAME or family.config_class in _BY_CLASS or clash:
        raise ValueError(f"Hugging Face family {family.name!r} is registered twice (or claims {clash})")
    _BY_NAME[family.name] = family
    _BY_CLASS[family.config_class] = family
    for model_type in family.model_types:
        _BY_MODEL_TYPE[model_type] = family
    return family


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in FAMILY_MODULES:
            importlib.import_module(f"{__package__}.{module}")


def families() -> list[HfFamily]:
    """Every registered family, in registration order."""
    _load()
    return list(_BY_NAME.values())


def _known() -> str:
    return ", ".join(repr(t) for f in families() for t in f.model_types)


def family_of(config: LmConfig) -> HfFamily:
    """The family of our ``config`` (by its exact class); ``ValueError`` when none is registered."""
    _load()
    family = _BY_CLASS.get(type(config))
    if family is None:
        raise ValueError(
            f"model type {type(config).__name__} has no Hugging Face mapping "
            f"({', '.join(f.name for f in families())} do)"
        )
    return family


def family_name(config: LmConfig) -> str:
    """Our ``model.type`` name of ``config``'s family, or its class name when it has none (for messages)."""
    _load()
    family = _BY_CLASS.get(type(config))
    return family.name if family is not None else type(config).__name__


def family_for_model_type(doc: dict, where: str) -> HfFamily:
    """The family that reads a ``config.json`` with this ``model_type``; ``ValueError`` naming the field."""
    _load()
    model_type = doc.get("model_type")
    family = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not supported: Hugging Face import and export know "
            f"{_known()} (the architectures levanter.models implements)"
        )
    return family


def hf_config_to_lm(doc: dict, where: str = "config.json") -> tuple[LmConfig, int]:
    """``(our model config, vocab_size)`` for a ``config.json`` document; ``ValueError`` naming the field
    we do not implement."""
    return family_for_model_type(doc, where).from_hf(doc, where)


def lm_to_hf_config(config: LmConfig, vocab_size: int) -> dict:
    """The ``config.json`` document for our ``config`` (refuses what the Hugging Face classes cannot express)."""
    try:
        family = family_of(config)
    except ValueError:
        raise ValueError(
            f"model type {type(config).__name__} cannot be exported to Hugging Face "
            f"({', '.join(f.name for f in families())} can)"
        ) from None
    return family.to_hf(config, vocab_size)


class _ShapeFields(Mapping):
    """``SHAPE_FIELDS[name]``: the weight-describing fields of each registered family (read lazily, so the
    families register first)."""

    def __getitem__(self, name: str) -> tuple[str, ...]:
        _load()
        return _BY_NAME[name].shape_fields

    def __iter__(self) -> Iterator[str]:
        return iter([f.name for f in families()])

    def __len__(self) -> int:
        return len(families())


# The model settings that describe the weights (taken from config.json), per family -- everything else in
# a model block (seq_len, attention backend, remat, scan, loss blocks, dropout...) stays the run's.
SHAPE_FIELDS: Mapping[str, tuple[str, ...]] = _ShapeFields()


# -- reading config.json fields, with errors that name them ------------------------------------------------


def hf_field(doc: dict, where: str, *names: str, default: Any = None, required: bool = False) -> Any:
    """The first of ``names`` that ``doc`` sets (not null), else ``default``; ``required``: error if none."""
    for n in names:
        if doc.get(n) is not None:
            return doc[n]
    if required:
        raise ValueError(f"{where}: field {names[0]!r} is missing")
    return default


def hf_int(doc: dict, where: str, *names: str, default: Any = None) -> int:
    """A positive integer field (required when ``default`` is None)."""
    value = hf_field(doc, where, *names, default=default, required=default is None)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}: field {names[0]!r} must be a positive integer, got {value!r}")
    return value


def refuse_true(doc: dict, where: str, names: tuple[str, ...], why: str) -> None:
    """Refuse each field of ``names`` that ``doc`` sets to a true value, saying ``why``."""
    for name in names:
        if doc.get(name):
            raise ValueError(f"{where}: field {name!r} true is not supported ({why})")
