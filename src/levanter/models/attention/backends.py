"""The attention backends by name (``model.attn_backend``): their validation, the platforms each runs
on, and the concrete kernel ``default`` means on this platform.

* ``vanilla``: the materialised-scores kernel (:mod:`.vanilla`): ``O(seq_len**2)`` memory per head, the
  fastest on CPU at short sequences, and the only one with attention-probability dropout.
* ``jax_flash``: blockwise attention in pure JAX (:mod:`.jax_flash`): online softmax over key blocks of
  ``model.flash_attention_block_size`` positions, recomputed per block in the backward pass; memory
  ``O(seq_len * block)``; runs everywhere.
* ``splash``: JAX's Pallas splash-attention kernel (:mod:`.splash`), on TPU only (elsewhere it runs only
  in Pallas's slow interpret mode, which the tests use).
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (:mod:`.cudnn`), on NVIDIA GPUs
  only, with bfloat16/float16 activations and head sizes up to 128 (a multiple of 8).
* ``default``: splash on TPU (when the sequence is a multiple of 128), cuDNN on GPU (when dtype and
  head size allow), else ``jax_flash`` for sequences of at least :data:`CPU_BLOCKWISE_MIN_SEQ_LEN`
  positions and ``vanilla`` below (where the materialised scores are small and faster on CPU).
  ``vanilla`` is also chosen whenever attention dropout is active.

A backend the platform cannot run is refused before any work by :func:`check_backend_platform` (run
by the training entry point's config checks), with an error naming ``model.attn_backend``. Upstream
Levanter's names are used where upstream has them.

The platform is the one the program is compiled for (:func:`attention_platform`): JAX's default backend,
except inside :func:`compiling_for`, where a plan compiles for devices this machine does not have (a TPU
slice's, ``train_lm --dry_run --slice``) and attention must be the kernel a run on them would use, not the
one this machine would.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

import jax

from .cudnn import cudnn_shapes_ok

__all__ = [
    "ATTN_BACKENDS",
    "DEFAULT_FLASH_BLOCK_SIZE",
    "CPU_BLOCKWISE_MIN_SEQ_LEN",
    "attention_platform",
    "check_attn_config",
    "check_backend_platform",
    "compiling_for",
    "resolve_attn_backend",
]

ATTN_BACKENDS = ("default", "vanilla", "jax_flash", "splash", "cudnn")
# Where each backend runs (jax.default_backend() names); jax_flash and vanilla run everywhere.
_BACKEND_PLATFORMS = {"splash": ("tpu",), "cudnn": ("gpu", "cuda")}
DEFAULT_FLASH_BLOCK_SIZE = 512
# On CPU, `default` picks blockwise attention from this sequence length on: below it the materialised
# scores are small and the single fused kernel is faster
# (docs/bench/2026-12-03-attention-and-loss.md).
CPU_BLOCKWISE_MIN_SEQ_LEN = 2048


def check_attn_config(backend: str, use_flash_attention: Optional[bool], block_size: Optional[int]) -> str:
    """The requested backend of a model config (``model.attn_backend``, or upstream's
    ``use_flash_attention`` when that alone is given: true means ``jax_flash``, false ``vanilla``), after
    checking the three keys; refuses unknown names, a conflict between the two keys, and a block size that
    is not a positive integer."""
    if backend is not None and backend not in ATTN_BACKENDS:
        hint = " (Transformer Engine is not available here; use cudnn)" if backend == "nvte" else ""
        raise ValueError(f"model.attn_backend {backend!r} is not one of {list(ATTN_BACKENDS)}{hint}")
    if use_flash_attention is not None and backend is not None:
        if use_flash_attention != (backend != "vanilla"):
            raise ValueError(
                f"model.use_flash_attention={str(use_flash_attention).lower()} conflicts with "
                f"model.attn_backend={backend!r}; remove model.use_flash_attention (attn_backend says which "
                "kernel to use)"
            )
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0):
        raise ValueError(f"model.flash_attention_block_size must be a positive integer, got {block_size!r}")
    if backend is not None:
        return backend
    if use_flash_attention is not None:
        return "jax_flash" if use_flash_attention else "vanilla"
    return "default"


# The platform a plan compiles for, where it is not JAX's default backend (see compiling_for).
_TARGET_PLATFORM: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("attention_platform", default=None)


def attention_platform() -> str:
    """The platform the attention being traced will run on: JAX's default backend, or the one
    :func:`compiling_for` names."""
    return _TARGET_PLATFORM.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
    """Inside, models resolve and build attention for ``platform`` (e.g. ``tpu``) instead of JAX's
    default backend: for compiling ahead of time for another platform's devices, whose compiler lowers
    that platform's kernels (splash's Pallas kernel for a TPU, lowered and compiled by libtpu here)."""
    token = _TARGET_PLATFORM.set(platform)
    try:
        yield
    finally:
        _TARGET_PLATFORM.reset(token)


def _platform_kind(platform: str) -> str:
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def check_backend_platform(backend: str, platform: str) -> None:
    """Refuse a backend the platform (``jax.default_backend()``) cannot run, naming ``model.attn_backend``."""
    allowed = _BACKEND_PLATFORMS.get(backend)
    if allowed is not None and platform not in allowed:
        where = "TPU" if backend == "splash" else "NVIDIA GPUs"
        raise ValueError(
            f"model.attn_backend {backend!r} runs only on {where}, but JAX's platform here is {platform!r}; "
            "use attn_backend: default (the best one this platform has) or jax_flash"
        )


def resolve_attn_backend(
    backend: str, *, platform: str, seq_len: int, dropout: float = 0.0, dtype=None, head_size: Optional[int] = None
) -> str:
    """The concrete backend ``vanilla | jax_flash | splash | cudnn`` that ``backend`` means here (see the
    module docstring for what ``default`` picks). ``dtype``/``head_size`` refine the GPU choice when known."""
    if backend != "default":
        check_backend_platform(backend, platform)
        return backend
    kind = _platform_kind(platform)
    if dropout > 0.0:
        return "vanilla"
    if kind == "tpu" and seq_len % 128 == 0:
        return "splash"
    if kind == "gpu" and platform != "rocm" and cudnn_shapes_ok(dtype, head_size):
        return "cudnn"
    if kind == "cpu" and seq_len < CPU_BLOCKWISE_MIN_SEQ_LEN:
        return "vanilla"
    return "jax_flash"
