"""How the trainer's compiled programs are dispatched: the train step called as a plain ``jax.jit`` over flat
leaves (:class:`FlatStep`), the step compiled ahead of time for the memory check and then reused
(:class:`Precompiled`), and the compiler options of the one-off initialisation program.

Trade-off: the flat path works out shardings once per structure of ``(state, batch)`` instead of on every
call, which saves milliseconds of Python per step; a structure it does not recognise falls back to
``haliax.named_jit``, which handles anything at the cost of that per-call work.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Dict, Optional, Tuple

import haliax as hax
import jax
import numpy as np

logger = logging.getLogger(__name__)


def init_compile_options(mesh) -> dict:
    """Compiler options for the one-off parameter-initialisation program.

    On CPU, XLA's LLVM pipeline spends seconds optimising the random-number code of a small model's init
    (threefry rounds and the normal transform for every parameter), to run it once in milliseconds; at
    backend optimisation level 0 it compiles several times faster (docs/bench/2026-12-03-cpu-levers.md). The
    values are deterministic either way, but not bit-identical between the two levels (LLVM compiles the float
    code of the normal transform differently), so the level is fixed here for every CPU run.
    Accelerators keep their defaults: their init is not this slow to compile, and large models' init is
    worth optimising.
    """
    if all(d.platform == "cpu" for d in np.asarray(mesh.devices).flat):
        return {"compiler_options": {"xla_backend_optimization_level": 0}}
    return {}


class FlatStep:
    """The train step called as a ``jax.jit`` over the flat leaves of ``(state, batch)`` (also the evaluator's
    sums, over ``(model, inputs)``, with ``donate=False``: the model outlives the call).

    ``haliax.named_jit`` re-derives, on every call, which leaves are arrays, their shardings and the
    output's shardings: milliseconds of Python per call for a small model's state
    (docs/bench/2026-12-03-cpu-levers.md), during which the device idles whenever nothing else is queued:
    after a step whose state the loop needed (a save, an evaluation), and for any step shorter than that
    Python. Those are fixed for a given structure of ``(state, batch)``, so they are worked out once per
    structure (the output shardings by the same ``infer_resource_partitions`` named_jit uses, from
    ``param_mapping``; inputs keep the shardings they have, as with named_jit) and a call is then a
    pytree flatten plus jax's C++ dispatch. A structure with a leaf that is not a ``jax.Array`` (or
    anything unusual) takes the named_jit path, which handles it.
    """

    def __init__(self, step: Callable, named: Callable, param_mapping, *, donate: bool = True):
        self._step = step
        self._named = named
        self._param_mapping = param_mapping
        self._donate = donate  # the state's buffers become the output's (the train step); not for evaluation
        self._by_structure: Dict[Any, Optional[Tuple[Callable, int, Any]]] = {}

    def __call__(self, state, batch):
        leaves, treedef = jax.tree_util.tree_flatten((state, batch))
        entry = self._by_structure.get(treedef, False)
        if entry is False:
            entry = self._by_structure[treedef] = self._build(state, batch, leaves)
        if entry is None:
            return self._named(state, batch)
        jitted, n_state, out_treedef = entry
        out = jitted(tuple(leaves[:n_state]), tuple(leaves[n_state:]))
        return jax.tree_util.tree_unflatten(out_treedef, out)

    def lower(self, state, batch) -> jax.stages.Lowered:
        """The step lowered for ``(state, batch)`` without running it; the leaves may be abstract
        (``jax.ShapeDtypeStruct`` with shardings), so nothing needs to be allocated."""
        leaves, _ = jax.tree_util.tree_flatten((state, batch))
        entry = self._build(state, batch, leaves, abstract=True)
        if entry is None:
            raise ValueError("the train step's outputs lack shardings: it cannot be lowered ahead of time")
        jitted, n_state, _ = entry
        return jitted.lower(tuple(leaves[:n_state]), tuple(leaves[n_state:]))

    def adopt(self, state, batch, compiled: jax.stages.Compiled) -> None:
        """Call ``compiled`` (this step compiled ahead of time for arguments like ``state`` and ``batch``)
        for arguments of their structure instead of compiling the jit for them."""
        leaves, treedef = jax.tree_util.tree_flatten((state, batch))
        entry = self._build(state, batch, leaves, abstract=True)
        if entry is not None:
            jitted, n_state, out_treedef = entry
            self._by_structure[treedef] = (Precompiled(compiled, jitted), n_state, out_treedef)

    def _build(self, state, batch, leaves, abstract: bool = False):
        if not abstract and not all(isinstance(x, jax.Array) for x in leaves):
            return None
        n_state = len(jax.tree_util.tree_leaves(state))
        state_def = jax.tree_util.tree_structure(state)
        batch_def = jax.tree_util.tree_structure(batch)
        step = self._step
        traced_out = []

        def flat(state_leaves, batch_leaves):
            out = step(
                jax.tree_util.tree_unflatten(state_def, state_leaves),
                jax.tree_util.tree_unflatten(batch_def, batch_leaves),
            )
            traced_out.append(jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), out))
            return tuple(jax.tree_util.tree_leaves(out))

        # One trace gives the output's structure and named axes; jax reuses it when `flat` is jitted
        # below with the same arguments.
        jax.eval_shape(flat, tuple(leaves[:n_state]), tuple(leaves[n_state:]))
        out_shape = traced_out[-1]
        out_treedef = jax.tree_util.tree_structure(out_shape)
        shardings = hax.partitioning.infer_resource_partitions(
            out_shape, self._param_mapping, preserve_existing_shardings=False
        )
        is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)  # noqa: E731
        out_shardings = jax.tree_util.tree_leaves(shardings, is_leaf=is_sharding)
        if len(out_shardings) != out_treedef.num_leaves or not all(map(is_sharding, out_shardings)):
            return None
        jitted = jax.jit(flat, out_shardings=tuple(out_shardings), donate_argnums=(0,) if self._donate else ())
        return jitted, n_state, out_treedef

    def compile_count(self) -> int:
        """Compiled executables so far (named_jit fallbacks count as one each): the trainer's guard against
        a step that compiles again."""
        total = 0
        for entry in self._by_structure.values():
            total += 1 if entry is None else entry[0]._cache_size()  # jax's jit, or Precompiled below
        return total


class Precompiled:
    """An ahead-of-time compiled step standing in for its jit; arguments it was not compiled for (another
    sharding, shape or dtype, which the executable refuses before running) go to the jit."""

    def __init__(self, compiled, jitted):
        self._compiled = compiled
        self._jitted = jitted
        self._ran = False

    def __call__(self, *args):
        if self._compiled is not None:
            try:
                out = self._compiled(*args)
                self._ran = True
                return out
            except (TypeError, ValueError) as e:
                logger.warning("the ahead-of-time compiled step does not take these arguments (%s): jit compiles", e)
                self._compiled = None
        return self._jitted(*args)

    def _cache_size(self) -> int:
        """As jax's jit counts its executables: the ahead-of-time one once it ran, and the jit's own."""
        return int(self._ran) + self._jitted._cache_size()

__all__ = ["FlatStep", "Precompiled", "init_compile_options"]
