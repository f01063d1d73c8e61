"""The files of a Hugging Face checkpoint: safetensors read and written directly, and the whole state dict.

The safetensors format (an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the raw bytes) is handled here rather than through the ``safetensors`` package:
that keeps torch out of the process, handles bfloat16 through ``ml_dtypes`` (which JAX ships), and lets
the bytes go through :mod:`levanter.utils.fs` to object stores. Local files are memory-mapped, so a large
checkpoint is not read twice into memory; a file on an object store is read whole (no ranged reads), which
costs memory for the largest shards. ``.bin`` (pickle) checkpoints are refused: reading them needs torch
and runs arbitrary code.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Optional

import numpy as np

from levanter.utils import fs

__all__ = [
    "CONFIG_FILE",
    "SAFE_WEIGHTS",
    "SAFE_INDEX",
    "TOKENIZER_FILES",
    "DEFAULT_MAX_SHARD_SIZE",
    "dtype_table",
    "HF_SAVE_DTYPES",
    "read_json",
    "read_safetensors",
    "safetensors_bytes",
    "check_weight_files",
    "load_state_dict",
]

CONFIG_FILE = "config.json"
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3  # bytes per safetensors file (transformers' default is 5 GB too)

# safetensors dtype names <-> numpy dtypes (bfloat16 through ml_dtypes, a JAX dependency).
def dtype_table() -> dict[str, Any]:
    import ml_dtypes

    return {
        "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
        "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
        "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    }


# hf_save_dtype values (upstream's spellings) -> safetensors dtype names.
HF_SAVE_DTYPES = {"float32": "F32", "fp32": "F32", "bfloat16": "BF16", "bf16": "BF16", "float16": "F16", "fp16": "F16"}


def read_json(path: str, what: str) -> dict:
    try:
        doc = json.loads(fs.read_bytes(path))
    except FileNotFoundError:
        raise ValueError(f"{what}: {path} does not exist") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{what}: {path} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{what}: {path} does not hold a JSON object")
    return doc


def _read_safetensors_header(path: str) -> tuple[dict, int, Any]:
    """``(header, offset of the data, source)``: source is a memory map (local) or the bytes (URL)."""
    if fs.is_url(path):
        data: Any = fs.read_bytes(path)
    elif os.path.getsize(fs.abspath(path)) < 8:  # an empty file cannot even be memory-mapped
        data = b""
    else:
        data = np.memmap(fs.abspath(path), dtype=np.uint8, mode="r")
    if len(data) < 8:
        raise ValueError(_too_short(path, len(data)))
    n = int(np.frombuffer(bytes(data[:8]), dtype="<u8")[0])
    if n > len(data) - 8:
        raise ValueError(f"{path} is not a safetensors file (its header length {n} exceeds the file)")
    try:
        header = json.loads(bytes(data[8 : 8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} is not a safetensors file ({e})") from None
    return header, 8 + n, data


def _too_short(path: str, size: int) -> str:
    what = "empty (0 bytes)" if size == 0 else f"{size} bytes, shorter than a safetensors header"
    return (f"{path} is {what}, not a safetensors file: the download or export that wrote it did not finish; "
            "download or export the checkpoint again")


def read_safetensors(path: str, names: Optional[Iterable[str]] = None) -> dict[str, np.ndarray]:
    """The tensors of one safetensors file (only ``names``, if given) as numpy arrays."""
    header, start, data = _read_safetensors_header(path)
    table = dtype_table()
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


def safetensors_bytes(tensors: dict[str, np.ndarray], names: dict[str, str]) -> bytes:
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


def check_weight_files(root: str, key: str = "") -> None:
    """Refuse, before any work, a checkpoint without safetensors weights (none, or ``.bin`` files only), or
    whose single weights file is too short to be one (an empty ``model.safetensors`` left by a download
    that did not finish). Only the file's size is asked for: nothing is read. ``key`` (``initialize_from_hf=...``)
    opens the message."""
    single = fs.join(root, SAFE_WEIGHTS)
    if fs.exists(fs.join(root, SAFE_INDEX)):
        return
    if not fs.exists(single):
        load_state_dict(root)  # raises the error that says what is there instead
    size = fs.size(single)
    if size < 8:
        raise ValueError(f"{key + ': ' if key else ''}{_too_short(single, size)}")


def load_state_dict(root: str) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint in ``root`` (single file, or the shards its index names)."""
    index = fs.join(root, SAFE_INDEX)
    single = fs.join(root, SAFE_WEIGHTS)
    if fs.exists(index):
        doc = read_json(index, "Hugging Face checkpoint index")
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
