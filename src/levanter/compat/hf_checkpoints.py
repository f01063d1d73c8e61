"""Hugging Face checkpoints in and out: GPT-2 and Llama models in the ``transformers`` layout.

* :func:`load_hf_config` maps a ``config.json`` onto our :class:`~levanter.models.Gpt2Config` or
  :class:`~levanter.models.LlamaConfig`. Options we do not implement (another architecture, a rope
  type other than default/linear/llama3/yarn (:mod:`levanter.models.rope`), biases in Llama, a head size
  other than ``hidden_size / num_attention_heads``) are refused, naming the ``config.json`` field, rather than loaded
  into a model that would compute something else.
* :func:`load_hf_checkpoint` reads the weights (``model.safetensors``, or the shards that
  ``model.safetensors.index.json`` names) into our model, in float32. ``.bin`` (pickle) checkpoints are
  refused: reading them needs torch and runs arbitrary code.
* :func:`save_hf_checkpoint` writes ``config.json``, the weights (one file, or shards of at most
  ``max_shard_size`` bytes plus the index) and, for a Hugging Face tokenizer, its files, so that
  ``transformers.AutoModelForCausalLM.from_pretrained`` loads the directory.
* :func:`merge_hf_model_config` and :class:`HfExporter` are what ``train_lm`` uses for
  ``initialize_from_hf`` and ``hf_save_path``.

Where a checkpoint comes from: a local directory, an object-store URL (through
:mod:`levanter.utils.fs`), or a hub id (``org/name``), downloaded with ``huggingface_hub`` when the hub is
reachable. Offline, a hub id fails in milliseconds (a DNS lookup; or ``HF_HUB_OFFLINE=1``) with one
paragraph, after looking in the local hub cache.

The safetensors format (an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the raw bytes) is read and written here directly rather than through the
``safetensors`` package: that keeps torch out of the process, handles bfloat16 through ``ml_dtypes`` (which
JAX ships), and lets the bytes go through :mod:`levanter.utils.fs` to object stores. Local files are
memory-mapped, so a large checkpoint is not read twice into memory.

Writes are all or nothing. Locally the directory is assembled under a ``.tmp-`` name beside the target and
renamed into place. On an object store, which has no rename, a stale ``config.json`` is deleted first and
written last: ``transformers`` cannot load a directory without it, so an interrupted export never looks
complete. Only an earlier export is ever replaced: each export writes a marker listing its files, and a
directory holding anything else is refused before any work (:mod:`levanter.compat.export_guard`).

Weight layouts. Our parameters are named arrays (``haliax``); each Hugging Face tensor is described by
groups of our axis names (``c_attn.weight`` of GPT-2 is ``[embed, (qkv, heads, head_size)]``, a torch
``Linear`` weight is ``[out, in]``), and per-layer tensors are stacked along our ``layers`` axis. The
same table drives import and export, so the two are exact inverses (an export then import is bit-identical).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import secrets
import shutil
from typing import Any, Iterable, Optional

import numpy as np

from levanter.models import Gpt2Config, LlamaConfig, LmConfig
from levanter.models.rope import rope_from_hf, rope_to_hf
from levanter.utils import fs

logger = logging.getLogger(__name__)

__all__ = [
    "HF_SAVE_DTYPES",
    "HfExporter",
    "load_hf_checkpoint",
    "load_hf_config",
    "load_hf_weights",
    "merge_hf_model_config",
    "resolve_hf_checkpoint",
    "save_hf_checkpoint",
    "weights_like",
]

CONFIG_FILE = "config.json"
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3  # bytes per safetensors file (transformers' default is 5 GB too)

# safetensors dtype names <-> numpy dtypes (bfloat16 through ml_dtypes, a JAX dependency).
def _dtype_table() -> dict[str, Any]:
    import ml_dtypes

    return {
        "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
        "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
        "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    }


# hf_save_dtype values (upstream's spellings) -> safetensors dtype names.
HF_SAVE_DTYPES = {"float32": "F32", "fp32": "F32", "bfloat16": "BF16", "bf16": "BF16", "float16": "F16", "fp16": "F16"}


# ------------------------------------------------------------------------------------------------
# Where a checkpoint is: a local directory, an object-store URL or a hub id
# ------------------------------------------------------------------------------------------------


def _could_be_hub_id(spec: str) -> bool:
    if spec.startswith(("/", ".", "~")) or "\\" in spec or "://" in spec:
        return False
    return spec.count("/") <= 1 and all(spec.split("/"))  # "gpt2" or "org/name"


def _hub_unreachable() -> Optional[str]:
    """Why the hub cannot be reached (a DNS failure), or None when its host resolves."""
    import socket
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        return f"the Hugging Face hub ({host}) is unreachable ({e})"
    return None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")


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
    if not _could_be_hub_id(spec):
        raise ValueError(
            f"Hugging Face {what} {spec!r} does not exist (resolved to {os.path.abspath(local)!r}); pass a "
            f"directory holding {CONFIG_FILE} and *.safetensors, or a hub id such as 'org/name'"
        )
    return _download(spec, what)


def _download(repo_id: str, what: str) -> str:
    from huggingface_hub import snapshot_download

    # A tokenizer needs its own files only, never a model's weights.
    patterns = list(TOKENIZER_FILES) if what == "tokenizer" else [CONFIG_FILE, "*.safetensors", SAFE_INDEX, *TOKENIZER_FILES]
    why = None if _offline() else _hub_unreachable()
    try:
        # Unreachable: the hub cache may still hold it (no network call with local_files_only).
        return snapshot_download(repo_id, allow_patterns=patterns, local_files_only=why is not None or _offline())
    except Exception as e:  # noqa: BLE001 -- every hub failure becomes the one paragraph below
        reason = why or ("HF_HUB_OFFLINE is set" if _offline() else f"{type(e).__name__}: {_first_line(e)}")
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


# ------------------------------------------------------------------------------------------------
# config.json <-> our model configs
# ------------------------------------------------------------------------------------------------


def _read_json(path: str, what: str) -> dict:
    try:
        doc = json.loads(fs.read_bytes(path))
    except FileNotFoundError:
        raise ValueError(f"{what}: {path} does not exist") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{what}: {path} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{what}: {path} does not hold a JSON object")
    return doc


def _read_hf_config_dict(path_or_id: str) -> tuple[str, dict]:
    root = resolve_hf_checkpoint(path_or_id)
    return root, _read_json(fs.join(root, CONFIG_FILE), "Hugging Face config")


def _get(doc: dict, where: str, *names: str, default: Any = None, required: bool = False) -> Any:
    for n in names:
        if doc.get(n) is not None:
            return doc[n]
    if required:
        raise ValueError(f"{where}: field {names[0]!r} is missing")
    return default


def _int(doc: dict, where: str, *names: str, default: Any = None) -> int:
    value = _get(doc, where, *names, default=default, required=default is None)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}: field {names[0]!r} must be a positive integer, got {value!r}")
    return value


def hf_config_to_lm(doc: dict, where: str = "config.json") -> tuple[LmConfig, int]:
    """``(our model config, vocab_size)`` for a ``config.json`` document; ``ValueError`` naming the field
    we do not implement."""
    model_type = doc.get("model_type")
    if model_type == "gpt2":
        return _gpt2_from_hf(doc, where)
    if model_type == "llama":
        return _llama_from_hf(doc, where)
    raise ValueError(
        f"{where}: model_type {model_type!r} is not supported: Hugging Face import and export know 'gpt2' and "
        "'llama' (the architectures levanter.models implements)"
    )


def _gpt2_from_hf(doc: dict, where: str) -> tuple[LmConfig, int]:
    d = _int(doc, where, "n_embd", "hidden_size")
    n_inner = doc.get("n_inner")
    if n_inner is not None and (not isinstance(n_inner, int) or n_inner % d != 0):
        raise ValueError(f"{where}: field 'n_inner' ({n_inner!r}) must be a multiple of n_embd ({d}) (model.mlp_scale)")
    if doc.get("scale_attn_weights", True) is not True:
        raise ValueError(f"{where}: field 'scale_attn_weights' false is not supported (attention is always scaled)")
    if doc.get("add_cross_attention"):
        raise ValueError(f"{where}: field 'add_cross_attention' is not supported (GPT-2 here is decoder-only)")
    if doc.get("tie_word_embeddings", True) is not True:
        raise ValueError(f"{where}: field 'tie_word_embeddings' false is not supported for GPT-2 (always tied here)")
    n_positions = _int(doc, where, "n_positions", "max_position_embeddings", default=1024)
    cfg = Gpt2Config(
        seq_len=min(n_positions, 1024),
        hidden_dim=d,
        num_layers=_int(doc, where, "n_layer", "num_hidden_layers"),
        num_heads=_int(doc, where, "n_head", "num_attention_heads"),
        mlp_scale=4 if n_inner is None else n_inner // d,
        initializer_range=float(doc.get("initializer_range", 0.02)),
        embed_pdrop=float(doc.get("embd_pdrop", 0.0)),
        resid_pdrop=float(doc.get("resid_pdrop", 0.0)),
        attn_pdrop=float(doc.get("attn_pdrop", 0.0)),
        layer_norm_epsilon=float(doc.get("layer_norm_epsilon", 1e-5)),
        activation_function=str(doc.get("activation_function", "gelu_new")),
        scale_attn_by_inverse_layer_idx=bool(doc.get("scale_attn_by_inverse_layer_idx", False)),
        n_positions=n_positions,
    )
    return cfg, _int(doc, where, "vocab_size")


def _llama_from_hf(doc: dict, where: str) -> tuple[LmConfig, int]:
    d = _int(doc, where, "hidden_size")
    heads = _int(doc, where, "num_attention_heads")
    kv = _int(doc, where, "num_key_value_heads", default=heads)
    head_dim = doc.get("head_dim")
    if head_dim is not None and head_dim * heads != d:
        raise ValueError(
            f"{where}: field 'head_dim' ({head_dim}) x num_attention_heads ({heads}) must equal hidden_size ({d}): "
            "a separate head size is not implemented"
        )
    for name in ("attention_bias", "mlp_bias"):
        if doc.get(name):
            raise ValueError(f"{where}: field {name!r} true is not supported (Llama here has no biases)")
    if doc.get("pretraining_tp", 1) not in (None, 1):
        raise ValueError(f"{where}: field 'pretraining_tp' other than 1 is not supported")
    theta, rope = rope_from_hf(doc, where)
    max_pos = _int(doc, where, "max_position_embeddings", default=2048)
    cfg = LlamaConfig(
        seq_len=min(max_pos, 2048),
        hidden_dim=d,
        intermediate_dim=_int(doc, where, "intermediate_size"),
        num_layers=_int(doc, where, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv,
        activation_function=str(doc.get("hidden_act", "silu")),
        initializer_range=float(doc.get("initializer_range", 0.02)),
        layer_norm_epsilon=float(doc.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(doc.get("tie_word_embeddings", False)),
        rope_theta=theta,
        rope=rope,
    )
    return cfg, _int(doc, where, "vocab_size")


def load_hf_config(path_or_id: str) -> LmConfig:
    """Our model config for the Hugging Face checkpoint ``path_or_id`` (its ``config.json``)."""
    root, doc = _read_hf_config_dict(path_or_id)
    return hf_config_to_lm(doc, fs.join(root, CONFIG_FILE))[0]


def lm_to_hf_config(config: LmConfig, vocab_size: int) -> dict:
    """The ``config.json`` document for our ``config`` (refuses what the Hugging Face classes cannot express)."""
    if isinstance(config, Gpt2Config):
        if not config.use_bias:
            raise ValueError("model.use_bias false cannot be exported: Hugging Face GPT-2 always has biases")
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": vocab_size,
            "n_positions": config.max_seq_len,
            "n_embd": config.hidden_dim,
            "n_layer": config.num_layers,
            "n_head": config.num_heads,
            "n_inner": config.hidden_dim * config.mlp_scale,
            "activation_function": config.activation_function,
            "resid_pdrop": config.resid_pdrop,
            "embd_pdrop": config.embed_pdrop,
            "attn_pdrop": config.attn_pdrop,
            "layer_norm_epsilon": config.layer_norm_epsilon,
            "initializer_range": config.initializer_range,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": config.scale_attn_by_inverse_layer_idx,
            "reorder_and_upcast_attn": False,
            "tie_word_embeddings": True,
            "use_cache": True,
        }
    if isinstance(config, LlamaConfig):
        if config.use_bias or not config.use_layer_norm_weight:
            raise ValueError(
                "model.use_bias true or model.use_layer_norm_weight false cannot be exported: Hugging Face Llama "
                "has no biases and always has norm weights"
            )
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": config.hidden_dim,
            "intermediate_size": config.intermediate_dim,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads,
            "head_dim": config.hidden_dim // config.num_heads,
            "hidden_act": config.activation_function,
            "max_position_embeddings": config.seq_len,
            "initializer_range": config.initializer_range,
            "rms_norm_eps": config.layer_norm_epsilon,
            "tie_word_embeddings": config.tie_word_embeddings,
            **rope_to_hf(config.rope_config),
            "attention_bias": False,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "use_cache": True,
        }
    raise ValueError(f"model type {type(config).__name__} cannot be exported to Hugging Face (gpt2 and llama can)")


# The model settings that describe the weights (taken from config.json) -- everything else in a model
# block (seq_len, attention backend, remat, scan, loss blocks, dropout...) stays the run's.
SHAPE_FIELDS = {
    "gpt2": ("hidden_dim", "num_layers", "num_heads", "mlp_scale", "layer_norm_epsilon", "activation_function",
             "scale_attn_by_inverse_layer_idx", "use_bias", "n_positions"),
    "llama": ("hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads", "activation_function",
              "layer_norm_epsilon", "tie_word_embeddings", "use_bias", "use_layer_norm_weight", "rope_theta", "rope"),
}


def _type_name(config: LmConfig) -> str:
    return "gpt2" if isinstance(config, Gpt2Config) else "llama" if isinstance(config, LlamaConfig) else type(config).__name__


def merge_hf_model_config(run_model: LmConfig, path_or_id: str, *, use_hf_model_config: bool = False,
                          key: str = "initialize_from_hf") -> tuple[LmConfig, int]:
    """``(model config, vocab_size)`` for a run that starts from the Hugging Face checkpoint ``path_or_id``.

    The fields that shape the weights (:data:`SHAPE_FIELDS`) come from ``config.json``; the rest
    (``seq_len``, ``attn_backend``, ``gradient_checkpointing``, ``scan_layers``, ``cross_entropy_block_size``...)
    stay the run's. With ``use_hf_model_config`` false, a model block of another ``type``, or a shape field the
    run set to a value other than both its default and the checkpoint's, is an error naming the key (a run
    must not silently train a model other than the one its YAML describes); with it true, the checkpoint's
    type and shape win whatever the YAML says.
    """
    root, doc = _read_hf_config_dict(path_or_id)
    hf, vocab = hf_config_to_lm(doc, fs.join(root, CONFIG_FILE))
    _check_weight_files(root)
    hf_type, run_type = _type_name(hf), _type_name(run_model)
    if hf_type != run_type:
        if not use_hf_model_config:
            raise ValueError(
                f"{key}={path_or_id!r} is a {hf_type} checkpoint but model.type is {run_type}: set model.type to "
                f"{hf_type}, or use_hf_model_config: true to take the whole model from the checkpoint"
            )
        run_model = type(hf)(seq_len=run_model.seq_len)
    defaults = type(hf)(seq_len=run_model.seq_len)
    changes = {}
    for name in SHAPE_FIELDS[hf_type]:
        mine, theirs, default = getattr(run_model, name), getattr(hf, name), getattr(defaults, name)
        if (not use_hf_model_config and mine != default and mine != theirs
                and not (name == "rope_theta" and run_model.rope is not None)):
            raise ValueError(
                f"model.{name}={mine!r} disagrees with {key}={path_or_id!r}, whose config.json gives {theirs!r}: "
                f"remove model.{name} from the config (the checkpoint's shape is used), or set "
                "use_hf_model_config: true to let the checkpoint override it"
            )
        changes[name] = theirs
    if hf_type == "gpt2":
        limit = hf.n_positions
        if run_model.seq_len > limit:
            raise ValueError(
                f"model.seq_len={run_model.seq_len} exceeds the {limit} learned positions of {key}={path_or_id!r} "
                "(n_positions in its config.json)"
            )
    return dataclasses.replace(run_model, **changes), vocab


# ------------------------------------------------------------------------------------------------
# safetensors files
# ------------------------------------------------------------------------------------------------


def _read_safetensors_header(path: str) -> tuple[dict, int, Any]:
    """``(header, offset of the data, source)``: source is a memory map (local) or the bytes (URL)."""
    if fs.is_url(path):
        data: Any = fs.read_bytes(path)
    else:
        data = np.memmap(fs.abspath(path), dtype=np.uint8, mode="r")
    if len(data) < 8:
        raise ValueError(f"{path} is not a safetensors file (shorter than its header)")
    n = int(np.frombuffer(bytes(data[:8]), dtype="<u8")[0])
    if n > len(data) - 8:
        raise ValueError(f"{path} is not a safetensors file (its header length {n} exceeds the file)")
    try:
        header = json.loads(bytes(data[8 : 8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} is not a safetensors file ({e})") from None
    return header, 8 + n, data


def read_safetensors(path: str, names: Optional[Iterable[str]] = None) -> dict[str, np.ndarray]:
    """The tensors of one safetensors file (only ``names``, if given) as numpy arrays."""
    header, start, data = _read_safetensors_header(path)
    table = _dtype_table()
    out = {}
    wanted = None if names is None else set(names)
    for name, info in header.items():
        if name == "__metadata__" or (wanted is not None and name not in wanted):
            continue
        dtype = table.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}, which is not supported")
        b, e = info["data_offsets"]
        shape = tuple(info["shape"])
        if e - b != dtype.itemsize * math.prod(shape) or start + e > len(data):
            raise ValueError(f"{path}: tensor {name!r} has a byte range that does not match its shape (truncated file?)")
        out[name] = np.frombuffer(data[start + b : start + e], dtype=dtype).reshape(shape)
    return out


def _safetensors_bytes(tensors: dict[str, np.ndarray], names: dict[str, str]) -> bytes:
    """One safetensors file: ``tensors`` (numpy) with safetensors dtype names ``names``."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, arr in tensors.items():
        n = arr.nbytes
        header[name] = {"dtype": names[name], "shape": list(arr.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    parts = [np.array([len(raw)], dtype="<u8").tobytes(), raw]
    parts += [np.ascontiguousarray(a).tobytes() for a in tensors.values()]
    return b"".join(parts)


def _check_weight_files(root: str) -> None:
    """Refuse, before any work, a checkpoint without safetensors weights (none, or ``.bin`` files only)."""
    if not (fs.exists(fs.join(root, SAFE_INDEX)) or fs.exists(fs.join(root, SAFE_WEIGHTS))):
        _load_state_dict(root)  # raises the error that says what is there instead


def _load_state_dict(root: str) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint in ``root`` (single file, or the shards its index names)."""
    index = fs.join(root, SAFE_INDEX)
    single = fs.join(root, SAFE_WEIGHTS)
    if fs.exists(index):
        doc = _read_json(index, "Hugging Face checkpoint index")
        weight_map = doc.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        out: dict[str, np.ndarray] = {}
        for file, names in sorted(files.items()):
            path = fs.join(root, file)
            if not fs.exists(path):
                raise ValueError(f"{index} names {file}, which does not exist in {root}")
            got = read_safetensors(path, names)
            missing = sorted(set(names) - set(got))
            if missing:
                raise ValueError(f"{path} lacks tensors {missing[:4]} that {SAFE_INDEX} puts there")
            out.update(got)
        return out
    if fs.exists(single):
        return read_safetensors(single)
    try:
        names = fs.listdir(root)
    except FileNotFoundError:
        names = []
    if any(n.endswith(".bin") or n.endswith(".pt") or n.endswith(".pth") for n in names):
        raise ValueError(
            f"Hugging Face checkpoint {root} has only PyTorch pickle weights (*.bin), which are not read here "
            "(loading them runs arbitrary code and needs torch). Convert them once: python -c \"import "
            f"transformers; transformers.AutoModelForCausalLM.from_pretrained('{root}').save_pretrained('OUT')\" "
            "writes model.safetensors."
        )
    raise ValueError(f"Hugging Face checkpoint {root} has neither {SAFE_WEIGHTS} nor {SAFE_INDEX}")


# ------------------------------------------------------------------------------------------------
# Weight layouts: our parameter path -> (HF tensor name, HF axes as groups of our axis names)
# ------------------------------------------------------------------------------------------------

L = "{i}"  # per-layer tensors: stacked along our `layers` axis

GPT2_LAYOUT: dict[str, tuple[str, tuple[tuple[str, ...], ...]]] = {
    "wte.weight": ("wte.weight", (("vocab",), ("embed",))),
    "wpe.weight": ("wpe.weight", (("position",), ("embed",))),
    "blocks.stacked.ln_1.weight": (f"h.{L}.ln_1.weight", (("embed",),)),
    "blocks.stacked.ln_1.bias": (f"h.{L}.ln_1.bias", (("embed",),)),
    "blocks.stacked.attn.c_attn.weight": (f"h.{L}.attn.c_attn.weight", (("embed",), ("qkv", "heads", "head_size"))),
    "blocks.stacked.attn.c_attn.bias": (f"h.{L}.attn.c_attn.bias", (("qkv", "heads", "head_size"),)),
    "blocks.stacked.attn.c_proj.weight": (f"h.{L}.attn.c_proj.weight", (("heads", "head_size"), ("embed",))),
    "blocks.stacked.attn.c_proj.bias": (f"h.{L}.attn.c_proj.bias", (("embed",),)),
    "blocks.stacked.ln_2.weight": (f"h.{L}.ln_2.weight", (("embed",),)),
    "blocks.stacked.ln_2.bias": (f"h.{L}.ln_2.bias", (("embed",),)),
    "blocks.stacked.mlp.c_fc.weight": (f"h.{L}.mlp.c_fc.weight", (("embed",), ("mlp",))),
    "blocks.stacked.mlp.c_fc.bias": (f"h.{L}.mlp.c_fc.bias", (("mlp",),)),
    "blocks.stacked.mlp.c_proj.weight": (f"h.{L}.mlp.c_proj.weight", (("mlp",), ("embed",))),
    "blocks.stacked.mlp.c_proj.bias": (f"h.{L}.mlp.c_proj.bias", (("embed",),)),
    "ln_f.weight": ("ln_f.weight", (("embed",),)),
    "ln_f.bias": ("ln_f.bias", (("embed",),)),
}

LLAMA_LAYOUT: dict[str, tuple[str, tuple[tuple[str, ...], ...]]] = {
    "embed_tokens.weight": ("model.embed_tokens.weight", (("vocab",), ("embed",))),
    "layers.stacked.input_layernorm.weight": (f"model.layers.{L}.input_layernorm.weight", (("embed",),)),
    "layers.stacked.self_attn.q_proj.weight": (
        f"model.layers.{L}.self_attn.q_proj.weight", (("heads", "head_size"), ("embed",))),
    "layers.stacked.self_attn.k_proj.weight": (
        f"model.layers.{L}.self_attn.k_proj.weight", (("kv_heads", "head_size"), ("embed",))),
    "layers.stacked.self_attn.v_proj.weight": (
        f"model.layers.{L}.self_attn.v_proj.weight", (("kv_heads", "head_size"), ("embed",))),
    "layers.stacked.self_attn.o_proj.weight": (
        f"model.layers.{L}.self_attn.o_proj.weight", (("embed",), ("heads", "head_size"))),
    "layers.stacked.post_attention_layernorm.weight": (
        f"model.layers.{L}.post_attention_layernorm.weight", (("embed",),)),
    "layers.stacked.mlp.gate_proj.weight": (f"model.layers.{L}.mlp.gate_proj.weight", (("mlp",), ("embed",))),
    "layers.stacked.mlp.up_proj.weight": (f"model.layers.{L}.mlp.up_proj.weight", (("mlp",), ("embed",))),
    "layers.stacked.mlp.down_proj.weight": (f"model.layers.{L}.mlp.down_proj.weight", (("embed",), ("mlp",))),
    "norm.weight": ("model.norm.weight", (("embed",),)),
    "lm_head.weight": ("lm_head.weight", (("vocab",), ("embed",))),
}

# Tensors some checkpoints carry that are not weights (causal-mask and rotary buffers of older versions).
_IGNORED = re.compile(r"(^|\.)attn\.(bias|masked_bias)$|rotary_emb\.inv_freq$")


def _layout(config: LmConfig):
    if isinstance(config, Gpt2Config):
        return GPT2_LAYOUT
    if isinstance(config, LlamaConfig):
        return LLAMA_LAYOUT
    raise ValueError(f"model type {type(config).__name__} has no Hugging Face layout (gpt2 and llama do)")


def _is_named(x) -> bool:
    import haliax as hax

    return isinstance(x, hax.NamedArray)


def _named_leaves(model) -> list[tuple[str, Any]]:
    import jax

    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_named)[0]
    out = []
    for path, leaf in flat:
        if _is_named(leaf):
            out.append((jax.tree_util.keystr(path).lstrip(".").replace("']", "").replace("['", "."), leaf))
    return out


def _hf_prefix(config: LmConfig, names: set[str]) -> str:
    """GPT-2 checkpoints name tensors ``transformer.wte.weight`` (GPT2LMHeadModel) or ``wte.weight`` (the
    original release); Llama's names are fixed."""
    if isinstance(config, Gpt2Config):
        return "" if "wte.weight" in names and "transformer.wte.weight" not in names else "transformer."
    return ""


def _hf_shape(axes_by_name: dict[str, int], groups) -> tuple[int, ...]:
    return tuple(math.prod(axes_by_name[a] for a in g) for g in groups)


def to_state_dict(model) -> dict[str, np.ndarray]:
    """Our model's weights as Hugging Face tensors (numpy, the parameters' dtype); tied heads omitted."""
    import jax

    config = model.config
    layout = _layout(config)
    prefix = "transformer." if isinstance(config, Gpt2Config) else ""
    out: dict[str, np.ndarray] = {}
    for path, arr in _named_leaves(model):
        if path not in layout:
            raise ValueError(f"parameter {path} has no Hugging Face name (use_bias or another unexported option?)")
        name, groups = layout[path]
        sizes = {a.name: a.size for a in arr.axes}
        order = tuple(a for g in groups for a in g)
        per_layer = L in name
        if per_layer:
            order = ("layers", *order)
        host = arr.rearrange(order).array
        if not getattr(host, "is_fully_addressable", True):
            from jax.experimental import multihost_utils

            host = multihost_utils.process_allgather(host, tiled=True)
        host = np.asarray(jax.device_get(host))
        shape = _hf_shape(sizes, groups)
        if per_layer:
            for i in range(sizes["layers"]):
                out[prefix + name.format(i=i)] = host[i].reshape(shape)
        else:
            out[prefix + name] = host.reshape(shape)
    return out


def weights_like(template, state_dict: dict[str, np.ndarray], *, where: str = "checkpoint"):
    """``template`` (a model, or its ``jax.eval_shape``) with every parameter taken from the Hugging Face
    ``state_dict``: same axes, dtype and (for arrays) sharding as the template's leaves."""
    import haliax as hax
    import jax
    import jax.numpy as jnp

    config = template.config
    layout = _layout(config)
    prefix = _hf_prefix(config, set(state_dict))
    used: set[str] = set()

    def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in state_dict:
            tied = name.endswith("lm_head.weight")
            raise ValueError(f"{where} has no tensor {name!r}" + (" (config.json says the head is untied)" if tied else ""))
        t = state_dict[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, but config.json implies {shape}")
        used.add(name)
        return np.asarray(t, dtype=np.float32)

    def build(path: str, leaf):
        if path not in layout:
            raise ValueError(f"parameter {path} has no Hugging Face name")
        name, groups = layout[path]
        sizes = {a.name: a.size for a in leaf.axes}
        shape = _hf_shape(sizes, groups)
        hf_axes = tuple(hax.Axis(a, sizes[a]) for g in groups for a in g)
        if L in name:
            stacked = np.stack([fetch(prefix + name.format(i=i), shape) for i in range(sizes["layers"])])
            data = stacked.reshape((sizes["layers"], *(a.size for a in hf_axes)))
            hf_axes = (hax.Axis("layers", sizes["layers"]), *hf_axes)
        else:
            data = fetch(prefix + name, shape).reshape(tuple(a.size for a in hf_axes))
        arr = hax.named(jnp.asarray(data), hf_axes).rearrange(tuple(a.name for a in leaf.axes))
        value = arr.array.astype(leaf.array.dtype)
        sharding = getattr(leaf.array, "sharding", None)
        if isinstance(leaf.array, jax.Array) and sharding is not None:
            value = jax.device_put(value, sharding)
        return hax.named(value, leaf.axes)

    leaves = dict(_named_leaves(template))
    flat, treedef = jax.tree_util.tree_flatten_with_path(template, is_leaf=_is_named)
    new_leaves = []
    for path, leaf in flat:
        if _is_named(leaf):
            key = jax.tree_util.keystr(path).lstrip(".").replace("']", "").replace("['", ".")
            new_leaves.append(build(key, leaves[key]))
        else:
            new_leaves.append(leaf)
    model = jax.tree_util.tree_unflatten(treedef, new_leaves)
    extra = sorted(n for n in set(state_dict) - used if not _IGNORED.search(n) and not _tied_copy(config, n))
    if extra:
        raise ValueError(
            f"{where} holds tensors this {_type_name(config)} model has no place for: {extra[:6]}"
            f"{' and more' if len(extra) > 6 else ''} (a different architecture, or options that are not implemented)"
        )
    return model


def _tied_copy(config: LmConfig, name: str) -> bool:
    """A head stored beside tied embeddings (some exporters write both)."""
    return name == "lm_head.weight" and (isinstance(config, Gpt2Config) or getattr(config, "tie_word_embeddings", False))


def load_hf_weights(template, path_or_id: str):
    """``template`` (our model, e.g. a freshly initialised one) with its parameters replaced by those of the
    Hugging Face checkpoint ``path_or_id``, in the template's dtypes and shardings."""
    root = resolve_hf_checkpoint(path_or_id)
    return weights_like(template, _load_state_dict(root), where=f"Hugging Face checkpoint {root}")


def load_hf_checkpoint(path_or_id: str, config: LmConfig | None = None, *, vocab_size: int | None = None):
    """``(config, model)``: the Hugging Face checkpoint ``path_or_id`` as our model, float32 parameters.

    ``config`` (default: :func:`load_hf_config`'s) gives the run settings (seq_len, attention backend...); its
    shape must agree with the checkpoint's. ``vocab_size`` (default: ``config.json``'s) must equal it.
    """
    import haliax as hax
    import jax

    root, doc = _read_hf_config_dict(path_or_id)
    where = fs.join(root, CONFIG_FILE)
    hf_config, hf_vocab = hf_config_to_lm(doc, where)
    if config is None:
        config = hf_config
    if vocab_size is not None and vocab_size != hf_vocab:
        raise ValueError(f"vocab_size={vocab_size} does not match the checkpoint's vocab_size {hf_vocab} ({where})")
    state = _load_state_dict(root)
    template = jax.eval_shape(lambda k: config.build(hax.Axis("vocab", hf_vocab), key=k), jax.random.PRNGKey(0))
    template = jax.tree.map(lambda s: np.zeros(s.shape, np.float32) if hasattr(s, "shape") else s, template)
    model = weights_like(template, state, where=f"Hugging Face checkpoint {root}")
    return config, model


# ------------------------------------------------------------------------------------------------
# Writing a Hugging Face directory
# ------------------------------------------------------------------------------------------------


def _tokenizer_files(tokenizer: Optional[str]) -> dict[str, bytes]:
    """The files of a Hugging Face tokenizer (a local directory or tokenizer.json, or a hub id); nothing for
    levanter's own ``byte`` and ``passthrough``."""
    if tokenizer is None or tokenizer in ("byte", "passthrough"):
        return {}
    local = os.path.expanduser(tokenizer)
    if os.path.isfile(local):
        local = os.path.dirname(os.path.abspath(local)) if os.path.basename(local) == "tokenizer.json" else local
    if os.path.isdir(local):
        root = local
    else:
        root = resolve_hf_checkpoint(tokenizer, what="tokenizer") if _could_be_hub_id(tokenizer) else None
        if root is None:
            raise ValueError(f"tokenizer {tokenizer!r} is neither a local directory nor a hub id")
    out = {}
    for name in TOKENIZER_FILES:
        path = fs.join(root, name)
        if fs.exists(path):
            out[name] = fs.read_bytes(path)
    if "tokenizer.json" not in out:
        raise ValueError(f"tokenizer {tokenizer!r} has no tokenizer.json to save with the model")
    cfg = json.loads(out.get("tokenizer_config.json", b"{}") or b"{}")
    if "tokenizer_class" not in cfg:  # transformers' AutoTokenizer needs to know which class reads tokenizer.json
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        out["tokenizer_config.json"] = json.dumps(cfg, indent=2).encode()
    return out


def _special_token_ids(tok_files: dict[str, bytes], vocab_size: int) -> dict:
    """``bos_token_id`` / ``eos_token_id`` for config.json: the tokenizer's (named in tokenizer_config.json and
    found among tokenizer.json's added tokens), else null -- never transformers' class defaults (GPT-2's 50256),
    which may lie outside a smaller vocabulary."""
    out: dict[str, Optional[int]] = {"bos_token_id": None, "eos_token_id": None}
    if "tokenizer.json" not in tok_files:
        return out
    try:
        added = {t["content"]: t["id"] for t in json.loads(tok_files["tokenizer.json"]).get("added_tokens", [])}
        cfg = json.loads(tok_files.get("tokenizer_config.json", b"{}") or b"{}")
    except (ValueError, KeyError, TypeError):
        return out
    for key in ("bos", "eos"):
        value = cfg.get(f"{key}_token")
        content = value.get("content") if isinstance(value, dict) else value
        tid = added.get(content) if isinstance(content, str) else None
        if isinstance(tid, int) and 0 <= tid < vocab_size:
            out[f"{key}_token_id"] = tid
    return out


def _shards(tensors: dict[str, np.ndarray], max_shard_size: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += arr.nbytes
    return shards


def save_hf_checkpoint(model, config: LmConfig, output_dir: str, *, tokenizer: str | None = None,
                       dtype: str | None = None, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                       source: Optional[dict] = None, label: Optional[str] = None) -> str:
    """Write ``model`` as a Hugging Face checkpoint directory ``output_dir`` (local path or URL); returns it.

    ``tokenizer``: the run's ``data.tokenizer`` (its files are copied for a Hugging Face tokenizer).
    ``dtype``: one of :data:`HF_SAVE_DTYPES` (default: the parameters' own). Above ``max_shard_size`` bytes
    the weights are split into ``model-0000k-of-0000n.safetensors`` files with an index. Only process 0
    writes; every process must call it (arrays sharded over several hosts are gathered). ``output_dir`` must be
    new, empty or exactly an earlier export (:mod:`levanter.compat.export_guard`; ``label`` names it in the
    error); the export's marker records ``source``, what was exported.
    """
    import jax

    from levanter.compat.export_guard import MARKER, check_replaceable, marker_bytes

    if dtype is not None and dtype not in HF_SAVE_DTYPES:
        raise ValueError(f"hf_save_dtype {dtype!r} is not one of {sorted(HF_SAVE_DTYPES)}")
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    if _type_name(model.config) != _type_name(config):
        raise ValueError(f"the model is a {_type_name(model.config)}, but the config is a {_type_name(config)}")
    if jax.process_index() == 0:
        check_replaceable(output_dir, label)
    doc = lm_to_hf_config(config, model.Vocab.size)
    tok_files = _tokenizer_files(tokenizer)
    state = to_state_dict(model)
    if jax.process_index() != 0:
        return output_dir
    table = {v: k for k, v in _dtype_table().items()}
    if dtype is not None:
        target = _dtype_table()[HF_SAVE_DTYPES[dtype]]
        state = {k: v.astype(target) for k, v in state.items()}
    names = {k: table[v.dtype] for k, v in state.items()}
    doc["torch_dtype"] = doc["dtype"] = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(
        next(iter(names.values())), "float32")
    doc["transformers_version"] = _transformers_version()

    files: dict[str, bytes] = {}
    shards = _shards(state, max_shard_size)
    if len(shards) == 1:
        files[SAFE_WEIGHTS] = _safetensors_bytes(state, names)
    else:
        weight_map = {}
        for k, shard in enumerate(shards, 1):
            file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            files[file] = _safetensors_bytes({n: state[n] for n in shard}, names)
            weight_map.update({n: file for n in shard})
        total = sum(v.nbytes for v in state.values())
        files[SAFE_INDEX] = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode()
    files.update(tok_files)
    doc.update(_special_token_ids(tok_files, model.Vocab.size))
    files[CONFIG_FILE] = json.dumps(doc, indent=2, sort_keys=True).encode()  # last: the commit record
    # The marker first: on an object store every file present from then on is one it lists.
    files = {MARKER: marker_bytes(files, source), **files}
    _commit(output_dir, files)
    return output_dir


def _transformers_version() -> str:
    """The installed transformers' version, recorded in config.json (without importing transformers)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return "4.0.0"


def _commit(output_dir: str, files: dict[str, bytes]) -> None:
    """Write ``files`` (config.json last) into ``output_dir`` all or nothing."""
    if fs.supports_rename(output_dir):
        final = fs.abspath(output_dir)
        parent = os.path.dirname(final)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".tmp-{os.path.basename(final)}-{secrets.token_hex(4)}")
        os.makedirs(tmp)
        try:
            for name, data in files.items():
                fs.atomic_write_bytes(os.path.join(tmp, name), data)
            old = None
            if os.path.exists(final):
                old = os.path.join(parent, f".tmp-{os.path.basename(final)}-old-{secrets.token_hex(4)}")
                os.rename(final, old)
            os.rename(tmp, final)
            fs.fsync_dir(parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return
    # Object store: no rename. Take away the old commit record first, write everything, the record last.
    url = fs.abspath(output_dir)
    fs.remove(fs.join(url, CONFIG_FILE))
    try:
        stale = set(fs.listdir(url)) - set(files)
    except FileNotFoundError:
        stale = set()
    for name in sorted(stale):
        fs.remove(fs.join(url, name))  # the guard let only an earlier export's files be here
    for name, data in files.items():
        if name != CONFIG_FILE:
            fs.atomic_write_bytes(fs.join(url, name), data)
    fs.atomic_write_bytes(fs.join(url, CONFIG_FILE), files[CONFIG_FILE])


# ------------------------------------------------------------------------------------------------
# Exports during training
# ------------------------------------------------------------------------------------------------


class HfExporter:
    """Exports the model of a training run to ``<base_path>/step-<N>`` every ``every`` steps and at
    ``last_step`` (upstream's layout for ``hf_save_path``). :meth:`wrap` puts it behind a checkpointer, whose
    ``on_step(state, step, force)`` the trainer calls after every step with the state after it."""

    def __init__(self, base_path: str, *, every: int, last_step: int, config: LmConfig,
                 tokenizer: Optional[str] = None, dtype: Optional[str] = None,
                 max_shard_size: int = DEFAULT_MAX_SHARD_SIZE):
        self.base_path, self.every, self.last_step = base_path, every, last_step
        self.config, self.tokenizer, self.dtype, self.max_shard_size = config, tokenizer, dtype, max_shard_size
        self.exported: list[str] = []

    def on_step(self, model, step: int) -> None:
        if step <= 0 or not (step % self.every == 0 or step == self.last_step):
            return
        path = fs.join(self.base_path, f"step-{step}")
        save_hf_checkpoint(model, self.config, path, tokenizer=self.tokenizer, dtype=self.dtype,
                           max_shard_size=self.max_shard_size, source={"exported_by": "train_lm", "step": step},
                           label=f"hf_save_path: the export directory {path!r}")
        self.exported.append(path)
        logger.info("exported step %d to %s (Hugging Face format)", step, path)

    def wrap(self, checkpointer) -> "_ExportingCheckpointer":
        return _ExportingCheckpointer(checkpointer, self)


class _ExportingCheckpointer:
    """A checkpointer that also hands each step's model to an :class:`HfExporter` (everything else is the
    wrapped checkpointer's)."""

    def __init__(self, inner, exporter: HfExporter):
        self._inner, self._exporter = inner, exporter

    def on_step(self, state, step: int, force: bool = False):
        out = self._inner.on_step(state, step, force=force)
        self._exporter.on_step(state.model, step)
        return out

    def __getattr__(self, name):
        return getattr(self._inner, name)
