"""Scoring token requests on a mesh: the device side of the harness, without the harness.

:func:`score_requests` takes ``(context tokens, continuation tokens)`` pairs and returns each one's summed
log-probability and greedy flag: it packs them into rows (:mod:`levanter.eval_harness.packing`), checks in a
multi-process job that every process packed the same rows, and scores the rows ``batch_size`` at a time
with a :class:`RowScorer`. :class:`levanter.eval_harness.lm.LevanterHarnessLM` answers the harness's
requests through it, and ``scripts/bench/eval_harness.py`` times it; nothing here imports ``lm_eval``.

The scoring program computes the logits of a block of positions of every row of the batch at a time (about
one row's worth per device), the rows on the devices that hold them and the output projection whole on
each device: every log-probability is a sum within one device, never a sum of per-device parts, so the
answers do not depend on how the processes of a job split the devices (one process of four devices and
two of two score bit for bit the same).
"""

from __future__ import annotations

import hashlib
import logging
from typing import List, Sequence, Tuple

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

from levanter.eval_harness.packing import PackedRequests, pack_requests
from levanter.quantization import quantize

__all__ = ["RowScorer", "score_requests", "check_same_requests", "logit_block"]

logger = logging.getLogger(__name__)


def logit_block(length: int, rows_per_device: int) -> int:
    """Positions per step of the logits loop: about ``length`` positions' logits per device at a time (one
    row's worth), a divisor of ``length``."""
    target = max(1, length // max(1, rows_per_device))
    return max(d for d in range(1, target + 1) if length % d == 0)


class RowScorer:
    """The device side: per-position log-probabilities and greedy flags of packed rows, ``batch_size`` rows
    at a time on ``trainer``'s mesh (its ``mesh``, ``mp``, ``compute_mapping``, ``param_mapping`` and
    ``config.quantization``), the batch split over the data axis."""

    def __init__(self, trainer, model, *, batch_size: int, length: int, batch_axis: str = "batch"):
        self.trainer = trainer
        self.batch_size = batch_size
        self.length = length
        self.batch_axis = batch_axis
        self.model = _on_mesh(trainer, model)
        self._fn = None

    def _compiled(self):
        if self._fn is None:
            from jax.sharding import NamedSharding, PartitionSpec

            from levanter.training import FlatStep

            mp = self.trainer.mp
            quantization = self.trainer.config.quantization
            mesh = self.trainer.mesh
            rows_on_device = NamedSharding(mesh, PartitionSpec("data", None, None))
            whole = NamedSharding(mesh, PartitionSpec(None, None))
            block = logit_block(self.length, self.batch_size // mesh.shape["data"])

            def score(model, batch):
                model = quantize(mp.cast_to_compute(model), quantization)
                kwargs = {"pos_ids": batch["positions"]} if model.absolute_positions else {}
                hidden = model.activations(batch["tokens"], batch["segment_ids"], **kwargs)
                Batch, Pos = batch["tokens"].axes
                h = hidden.rearrange((Batch.name, Pos.name, model.Embed.name)).array
                head = model.get_lm_head().rearrange((model.Vocab.name, model.Embed.name)).array
                head = jax.lax.with_sharding_constraint(head, whole)
                rows, length, embed = h.shape
                # [blocks, rows, block, ...]: step i is positions i*block.. of every row
                hb = h.reshape(rows, length // block, block, embed).swapaxes(0, 1)
                tb = batch["targets"].array.reshape(rows, length // block, block).swapaxes(0, 1)

                def one_block(args):
                    hr, tr = args
                    hr = jax.lax.with_sharding_constraint(hr, rows_on_device)
                    logits = jnp.einsum("rpe,ve->rpv", hr, head, preferred_element_type=jnp.float32)
                    log_z = jax.nn.logsumexp(logits, axis=-1)
                    target = jnp.take_along_axis(logits, tr[..., None], axis=-1)[..., 0]
                    return target - log_z, jnp.argmax(logits, axis=-1) == tr

                logprobs, greedy = jax.lax.map(one_block, (hb, tb))
                logprobs = logprobs.swapaxes(0, 1).reshape(rows, length)
                greedy = greedy.swapaxes(0, 1).reshape(rows, length)
                return hax.named(logprobs, (Batch, Pos)), hax.named(greedy, (Batch, Pos))

            named = hax.named_jit(score, axis_resources=self.trainer.compute_mapping)
            self._fn = FlatStep(score, named, self.trainer.param_mapping, donate=False)
        return self._fn

    def device_batch(self, packed: PackedRequests, start: int) -> dict:
        """Rows ``start`` .. ``start + batch_size`` of ``packed`` as the program's input on the mesh."""
        from jax.sharding import NamedSharding, PartitionSpec

        sharding = NamedSharding(self.trainer.mesh, PartitionSpec("data", None))
        Batch = hax.Axis(self.batch_axis, self.batch_size)
        Pos = hax.Axis("position", self.length)
        host = {name: getattr(packed, name)[start:start + self.batch_size]
                for name in ("tokens", "targets", "segment_ids", "positions")}
        return {name: hax.named(jax.make_array_from_callback(a.shape, sharding, lambda idx, a=a: a[idx]),
                                (Batch, Pos)) for name, a in host.items()}

    def run(self, batch: dict):
        """The scoring program on one :meth:`device_batch`: ``(logprobs, greedy)`` on the mesh, not yet read."""
        with hax.partitioning.set_mesh(self.trainer.mesh), hax.axis_mapping(self.trainer.compute_mapping):
            return self._compiled()(self.model, batch)

    def compile(self, batch: dict) -> jax.stages.Compiled:
        """Compile the scoring program for batches like ``batch`` now (the first :meth:`run` then only runs
        it): to time the compile apart, or to inspect the program (``as_text()``, ``memory_analysis()``)."""
        fn = self._compiled()
        with hax.partitioning.set_mesh(self.trainer.mesh), hax.axis_mapping(self.trainer.compute_mapping):
            compiled = fn.lower(self.model, batch).compile()
            fn.adopt(self.model, batch, compiled)
        return compiled

    def score(self, packed: PackedRequests) -> Tuple[np.ndarray, np.ndarray]:
        """``(logprobs, greedy)``, ``[rows, length]`` numpy arrays on every process, of ``packed`` (padded
        here to whole batches)."""
        rows = packed.num_rows
        packed = packed.padded_to(self.batch_size)
        out_lp: list = []
        out_greedy: list = []
        pending = None
        for start in range(0, packed.num_rows, self.batch_size):
            out = self.run(self.device_batch(packed, start))
            if pending is not None:  # the previous batch is read once this one is dispatched
                _collect(pending, out_lp, out_greedy)
            pending = out
        if pending is not None:
            _collect(pending, out_lp, out_greedy)
        return np.concatenate(out_lp)[:rows], np.concatenate(out_greedy)[:rows]


def score_requests(scorer: RowScorer, requests: Sequence[Tuple[Sequence[int], Sequence[int]]], *,
                   max_segments: int = 64) -> List[Tuple[float, bool]]:
    """``(summed log-probability, greedy)`` of each ``(context tokens, continuation tokens)``: packed into
    rows of ``scorer.length`` positions (at most ``max_segments`` requests a row) and scored by ``scorer``."""
    if not requests:
        return []
    packed = pack_requests(requests, scorer.length, max_segments=max_segments)
    if packed.truncated:
        logger.info("%d of %d requests were longer than %d tokens: their contexts were cut from the left",
                    packed.truncated, len(requests), scorer.length)
    check_same_requests(packed)
    logprobs, greedy = scorer.score(packed)
    return packed.results(logprobs, greedy)


def _collect(out, out_lp: list, out_greedy: list) -> None:
    from jax.experimental import multihost_utils

    for named, dest in zip(out, (out_lp, out_greedy)):
        x = named.array
        if not x.is_fully_addressable:  # rows on other processes' devices: every process reads them all
            x = multihost_utils.process_allgather(x, tiled=True)
        dest.append(np.asarray(x))


def _on_mesh(trainer, model):
    """``model`` with every array on the trainer's mesh (placed by the parameter mapping when it is not)."""
    mesh_devices = set(trainer.mesh.devices.flat)
    arrays = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    if all(isinstance(x, jax.Array) and set(x.sharding.device_set) == mesh_devices for x in arrays):
        return model
    with hax.partitioning.set_mesh(trainer.mesh):
        return hax.shard(model, trainer.param_mapping)


def check_same_requests(packed: PackedRequests) -> None:
    """In a multi-process job, refuse to score unless every process packed the same rows: they would
    otherwise run different programs in lockstep (a hang) or mix answers."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    h = hashlib.sha256()
    for a in (packed.tokens, packed.targets, packed.segment_ids, packed.scored):
        h.update(np.ascontiguousarray(a).tobytes())
    digest = np.frombuffer(h.digest(), dtype=np.uint32)
    everyone = np.asarray(multihost_utils.process_allgather(digest))
    if not (everyone == everyone[0]).all():
        raise RuntimeError(
            "the processes were handed different lm-evaluation-harness requests (the tasks' documents or few-shot "
            "examples differ between processes): check that every process sees the same task files"
        )
