"""Evaluation of a language model on its validation sources: loss and bits per byte, per source and tag.

:class:`Evaluator` reads every validation source in fixed batches (sequences ``[k*B, (k+1)*B)`` of the
unshuffled set, the first ``max_batches`` of them, each source on its own), runs one compiled function
per batch that returns three sums -- the next-token cross-entropy in nats over the loss positions, the
number of those positions, and the UTF-8 bytes of the tokens they predict -- and adds them up on the
host per source. Every metric is a ratio of those sums, so it does not depend on the batch size, on how
many processes read the data, or on how the batch is sharded (the batches themselves are the same for
any process count: the loader assigns sequences to steps, not to processes).

Metrics (``prefix`` is ``eval``), with upstream Levanter's names:

* ``eval/<source>/loss``: the source's mean loss per predicted token (nats); ``eval/<source>/bpb``: its
  bits per byte, ``summed loss / (ln 2 x bytes of the predicted tokens)``.
* ``eval/loss`` and ``eval/bpb``: micro averages, every predicted token (byte) of every source weighted
  alike; ``eval/macro_loss`` and ``eval/macro_bpb``: macro averages, the mean over sources of their own
  averages (each source counts once, however large).
* ``eval/<tag>/loss`` and ``eval/<tag>/bpb`` for each tag in the sources' ``tags``: the micro average
  over the sources carrying it, and ``eval/<tag>/macro_loss`` / ``eval/<tag>/macro_bpb`` (the mean over
  those sources) where it covers more than one. Tags are hierarchical with ``/`` as separator: a source
  tagged ``web/en`` also counts towards ``web``, whose micro average is logged as
  ``eval/web/micro_loss`` (upstream's name for a parent's micro average).

Bytes per token come from the tokenizer (:func:`token_byte_lengths`): 1 for each id of the byte tokenizer,
the UTF-8 length of the text a Hugging Face token stands for (byte-level BPE symbols mapped back to their
bytes, ``<0xNN>`` byte-fallback pieces 1, SentencePiece's ``▁`` the one byte of a space). Special tokens
(EOS, BOS, padding) count 0 bytes: predicting EOS costs loss but stands for no text. Pre-tokenized data
(the passthrough tokenizer) has no bytes: no ``bpb`` metrics are reported for it.

Trade-offs. Upstream averages bits per byte over batches weighted by tokens; here it is the exact ratio
of sums, so ``eval/bpb`` equals ``eval/loss x tokens / (bytes x ln 2)``. The loss is the plain
cross-entropy (no z-loss), whatever the training loss adds. ``max_batches`` limits each source
separately (upstream limits the concatenation of all sources).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

from levanter.data.dataset import AsyncDataset
from levanter.data.loader import DataLoader
from levanter.quantization import quantize
from .dispatch import FlatStep

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = [
    "EvalResult",
    "EvalSet",
    "Evaluator",
    "SourceTotals",
    "check_eval_set_sizes",
    "make_evaluator",
    "format_table",
    "token_byte_lengths",
]

LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """One validation source: its name (as reported in metric names), its dataset of
    ``{tokens, loss_mask, segment_ids}`` examples, and its tags."""

    name: str
    dataset: AsyncDataset
    tags: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class SourceTotals:
    """Sums over one source's evaluated sequences: loss in nats, predicted tokens, their UTF-8 bytes."""

    loss: float
    tokens: int
    bytes: int
    sequences: int

    @property
    def mean_loss(self) -> float:
        return self.loss / self.tokens if self.tokens else float("nan")

    @property
    def bpb(self) -> float:
        return self.loss / (LN2 * self.bytes) if self.bytes else float("nan")


def token_byte_lengths(tokenizer, vocab_size: int) -> Optional[np.ndarray]:
    """UTF-8 bytes each token id stands for (int32, ``vocab_size`` entries; ids beyond the tokenizer's
    vocabulary and special tokens 0), or None when the tokenizer has no text (passthrough)."""
    from levanter.ingest import ByteTokenizer, HfTokenizer

    out = np.zeros(vocab_size, dtype=np.int32)
    if isinstance(tokenizer, ByteTokenizer):
        out[: min(256, vocab_size)] = 1
        return out
    if isinstance(tokenizer, HfTokenizer):
        return _hf_byte_lengths(tokenizer.backend, out)
    return None


def _hf_byte_lengths(tok, out: np.ndarray) -> np.ndarray:
    """Byte lengths of a ``tokenizers.Tokenizer``'s tokens, from the token strings themselves.

    A byte-level BPE (GPT-2 style) writes each byte as one printable character of a fixed alphabet, so a
    token's byte count is its character count once every character is in that alphabet; other models
    (SentencePiece-style) hold text, with ``<0xNN>`` pieces for single bytes and ``▁`` for a space."""
    from tokenizers import pre_tokenizers

    byte_alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    is_byte_level = _uses_byte_level(tok)
    for token, tid in tok.get_vocab(with_added_tokens=True).items():
        if tid >= len(out) or token in special:
            continue
        if is_byte_level and all(c in byte_alphabet for c in token):
            n = len(token)
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            n = 1
        else:
            n = len(token.replace("\u2581", " ").encode("utf-8", "surrogatepass"))
        out[tid] = n
    return out


def _uses_byte_level(tok) -> bool:
    import json

    spec = json.loads(tok.to_str())

    def has_byte_level(node) -> bool:
        if isinstance(node, dict):
            if node.get("type") == "ByteLevel":
                return True
            return any(has_byte_level(v) for v in node.values())
        if isinstance(node, list):
            return any(has_byte_level(v) for v in node)
        return False

    return has_byte_level(spec.get("pre_tokenizer")) or has_byte_level(spec.get("decoder"))


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Per-source totals, in the sources' order, and their tags; :meth:`metrics` gives the logged dict."""

    totals: Dict[str, SourceTotals]
    tags: Dict[str, Tuple[str, ...]]
    has_bytes: bool

    def tag_members(self) -> Dict[str, Tuple[List[str], bool]]:
        """``{tag: (sources carrying it, declared)}``: declared tags and their ``/`` parents (undeclared)."""
        found: Dict[str, Tuple[List[str], bool]] = {}
        for name, tags in self.tags.items():
            for tag in tags:
                parts = tag.split("/")
                for i in range(1, len(parts) + 1):
                    t = "/".join(parts[:i])
                    declared = i == len(parts)
                    members, was_declared = found.get(t, ([], False))
                    if name not in members:
                        members.append(name)
                    found[t] = (members, was_declared or declared)
        return found

    def metrics(self, prefix: str = "eval") -> Dict[str, float]:
        out: Dict[str, float] = {}
        counted = {n: t for n, t in self.totals.items() if t.tokens}
        if not counted:
            return out
        for name, t in counted.items():
            out[f"{prefix}/{name}/loss"] = t.mean_loss
            if self.has_bytes:
                out[f"{prefix}/{name}/bpb"] = t.bpb
        self._aggregate(out, prefix, list(counted.values()), micro="loss")
        for tag, (members, declared) in self.tag_members().items():
            ts = [counted[m] for m in members if m in counted]
            if ts:
                self._aggregate(out, f"{prefix}/{tag}", ts, micro="loss" if declared else "micro_loss",
                                macro=len(ts) > 1)
        return out

    def _aggregate(self, out, prefix: str, ts: List[SourceTotals], *, micro: str, macro: bool = True) -> None:
        loss, tokens, nbytes = sum(t.loss for t in ts), sum(t.tokens for t in ts), sum(t.bytes for t in ts)
        out[f"{prefix}/{micro}"] = loss / tokens
        if macro:
            out[f"{prefix}/macro_loss"] = float(np.mean([t.mean_loss for t in ts]))
        if self.has_bytes:
            out[f"{prefix}/bpb"] = loss / (LN2 * nbytes) if nbytes else float("nan")
            if macro:
                out[f"{prefix}/macro_bpb"] = float(np.mean([t.bpb for t in ts]))


def format_table(result: EvalResult) -> str:
    """The result as a text table: one row per source, then the micro and macro averages."""
    m = result.metrics()
    rows = [("source", "sequences", "tokens", "loss", "bpb")]

    def bpb(v: Optional[float]) -> str:
        return "-" if v is None or not result.has_bytes else f"{v:.4f}"

    for name, t in result.totals.items():
        rows.append((name, f"{t.sequences:,}", f"{t.tokens:,}", f"{t.mean_loss:.4f}", bpb(t.bpb)))
    if m:
        seqs = sum(t.sequences for t in result.totals.values())
        toks = sum(t.tokens for t in result.totals.values())
        micro = (f"{m['eval/loss']:.4f}", bpb(m.get("eval/bpb")))
        rows.append(("micro average", f"{seqs:,}", f"{toks:,}", *micro))
        rows.append(("macro average", "", "", f"{m['eval/macro_loss']:.4f}", bpb(m.get("eval/macro_bpb"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if k == 0 or k == len(result.totals):
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


class Evaluator:
    """Evaluates a model on ``eval_sets`` in batches of ``batch_size`` sequences on ``trainer``'s mesh,
    in its compute precision and axis mapping (the trainer's ``mesh``, ``mp``, ``compute_mapping``).

    ``byte_lengths``: :func:`token_byte_lengths` of the data's tokenizer (None: no bits per byte).
    ``max_batches``: at most this many batches per source (None: all; a trailing partial batch is
    never evaluated)."""

    def __init__(
        self,
        trainer: Trainer,
        eval_sets: Sequence[EvalSet],
        *,
        batch_size: int,
        Pos: hax.Axis,
        byte_lengths: Optional[np.ndarray],
        max_batches: Optional[int] = None,
        batch_axis: str = "batch",
    ):
        self.trainer = trainer
        self.eval_sets = list(eval_sets)
        self.batch_size = batch_size
        self.Pos = Pos
        self.max_batches = max_batches
        self.batch_axis = batch_axis
        self.has_bytes = byte_lengths is not None
        table = np.zeros(1, np.int32) if byte_lengths is None else np.asarray(byte_lengths, np.int32)
        self._byte_lengths = jnp.asarray(table)
        self._fn = None

    def _sums_fn(self):
        if self._fn is None:
            mp = self.trainer.mp
            # trainer.quantization: evaluated through the same int8 products as trained (levanter.quantization).
            quantization = self.trainer.config.quantization

            def sums(model, inputs):
                batch, byte_lengths = inputs
                tokens, mask = batch["tokens"], batch["loss_mask"]
                model = quantize(mp.cast_to_compute(model), quantization)
                total, count = model.compute_next_token_loss(
                    tokens, mask, batch["segment_ids"], reduction="sum_and_count"
                )
                # Position t predicts token t+1 where the mask is set (the last position predicts nothing).
                ids = tokens.array
                valid = mask.array[:, :-1] != 0
                nbytes = jnp.sum(jnp.where(valid, jnp.take(byte_lengths, ids[:, 1:], mode="clip"), 0))
                return total.astype(jnp.float32), count.astype(jnp.float32), nbytes.astype(jnp.int32)

            # Called as the train step is (levanter.training.dispatch.FlatStep): named_jit would re-derive the
            # model's array leaves and shardings on every batch, milliseconds of Python per batch.
            named = hax.named_jit(sums, axis_resources=self.trainer.compute_mapping)
            self._fn = FlatStep(sums, named, self.trainer.param_mapping, donate=False)
        return self._fn

    def _on_mesh(self, model):
        """``model`` with every array on the trainer's mesh: as it is when it is there already (the training
        state), else placed by the parameter mapping (a model loaded onto one device, say), since the sums'
        jit takes its arguments where they are."""
        mesh_devices = set(self.trainer.mesh.devices.flat)
        arrays = jax.tree.leaves(eqx.filter(model, eqx.is_array))
        if all(isinstance(x, jax.Array) and set(x.sharding.device_set) == mesh_devices for x in arrays):
            return model
        with hax.partitioning.set_mesh(self.trainer.mesh):
            return hax.shard(model, self.trainer.param_mapping)

    def evaluate(self, model) -> EvalResult:
        fn = self._sums_fn()
        totals: Dict[str, SourceTotals] = {}
        trainer = self.trainer
        model = self._on_mesh(model)
        for es in self.eval_sets:
            loader = DataLoader(es.dataset, self.batch_size, mesh=trainer.mesh, data_axis="data",
                                prefetch_depth=2)
            loss = 0.0
            tokens = nbytes = seqs = 0
            pending = None  # the previous batch's sums, read once the next batch is dispatched

            def add(sums) -> None:
                nonlocal loss, tokens, nbytes
                t, c, b = sums
                loss += float(t)
                tokens += int(round(float(c)))
                nbytes += int(b)

            with loader.iter_from_step(0, self.max_batches) as it:
                for batch in it:
                    named = _named(batch.data, self.Pos, self.batch_axis)
                    with hax.partitioning.set_mesh(trainer.mesh), hax.axis_mapping(trainer.compute_mapping):
                        out = fn(model, (named, self._byte_lengths))
                    if pending is not None:
                        add(pending)
                    pending = out
                    seqs += batch.batch_size
            if pending is not None:
                add(pending)
            totals[es.name] = SourceTotals(loss, tokens, nbytes if self.has_bytes else 0, seqs)
        return EvalResult(totals, {es.name: es.tags for es in self.eval_sets}, self.has_bytes)


def _named(data, Pos: hax.Axis, batch_axis: str) -> dict:
    def name(x):
        return hax.named(x, (hax.Axis(batch_axis, x.shape[0]), Pos))

    return {k: name(v) for k, v in data.items()}


def _validation_key(name: str) -> str:
    return f"data.configs.{name}.validation_urls" if name else "data.validation_urls"


def check_eval_set_sizes(validation_sets: Dict[str, AsyncDataset], trainer_config, seq_len: int) -> None:
    """Refuse a validation set (``data_config.validation_sets``: ``{source name or "": dataset}``) too small
    for one eval batch: evaluating it would silently do nothing (a trailing partial batch is not
    evaluated)."""
    import asyncio

    bs = trainer_config.eval_batch_size
    for name, ds in validation_sets.items():
        n = asyncio.run(ds.async_len())
        if n >= bs:
            continue
        raise ValueError(
            f"{_validation_key(name)}: the validation set has {n} sequences of model.seq_len={seq_len} tokens, "
            f"fewer than one eval batch of {bs}, so it would never be evaluated. Add validation data, evaluate "
            f"in smaller batches (trainer.per_device_eval_parallelism x {trainer_config.data_axis_size} "
            "data-parallel devices), or remove the validation_urls."
        )


def make_evaluator(trainer: Trainer, data_config, validation_sets: Dict[str, AsyncDataset], tokenizer, vocab_size: int,
                   Pos: hax.Axis) -> Evaluator:
    """The evaluator of a data config's validation sources (``data_config.validation_sets``; a single source
    is named ``data``) with their checked tags, in batches of ``trainer.config.eval_batch_size``, at most
    ``trainer.config.max_eval_batches`` per source."""
    tags = data_config.eval_tags()
    sets = [EvalSet(name or "data", ds, tags.get(name, ())) for name, ds in validation_sets.items()]
    tcfg = trainer.config
    return Evaluator(trainer, sets, batch_size=tcfg.eval_batch_size, Pos=Pos,
                     byte_lengths=token_byte_lengths(tokenizer, vocab_size), max_batches=tcfg.max_eval_batches,
                     batch_axis=tcfg.batch_axis)

