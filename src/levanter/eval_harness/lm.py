"""The model as lm-evaluation-harness sees it: :class:`LevanterHarnessLM` answers the harness's requests in
JAX on the run's mesh, with the run's tokenizer.

* ``loglikelihood``: for each ``(context, continuation)``, the summed log-probability of the continuation's
  tokens and whether greedy decoding would produce exactly them. Strings become tokens by the harness's own
  rule (``lm_eval.api.model.TemplateLM``: trailing spaces of the context move to the continuation, the
  continuation's tokens are those of ``context + continuation`` past the context's, an empty context is
  the prefix token), the same as its Hugging Face backend, so the two score the same tokens.
* ``loglikelihood_rolling``: a whole document's log-likelihood, cut into windows of the evaluation length
  by the harness's own rule (``lm_eval.utils.get_rolling_token_windows`` with one token of context, made
  disjoint by ``make_disjoint_window``), the first conditioned on the prefix token.
* ``generate_until``: refused (one error naming the tasks); levanter scores, it does not generate.

Requests are packed several to a row (:mod:`levanter.eval_harness.packing`), rows batched
``batch_size`` at a time, and one compiled program per evaluation length returns every position's
log-probability and greedy flag. The packing is a pure function of the set of requests, so in a
multi-process job every process builds the same batches and takes part in each; the processes check
that they were handed the same requests (a hash compared across processes) before the first batch.

The prefix token is the tokenizer's BOS, else its EOS (the Hugging Face backend's choice); tokens are
encoded without special tokens (that backend's default for causal models).

Importing this module imports ``lm_eval`` (the ``eval`` extra): the rest of levanter imports it only
when a harness evaluation runs.
"""

from __future__ import annotations

import hashlib
import logging
from typing import List, Optional, Sequence, Tuple

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from lm_eval import utils as lm_eval_utils
from lm_eval.api.model import TemplateLM

from levanter.eval_harness.packing import PackedRequests, pack_requests
from levanter.quantization import quantize

__all__ = ["LevanterHarnessLM", "RowScorer", "GenerationRefused"]

logger = logging.getLogger(__name__)


class GenerationRefused(ValueError):
    """A task asked the model to generate text (``generate_until``), which is not built."""


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
            from jax.experimental import multihost_utils  # noqa: F401 -- imported where the outputs are gathered

            from levanter.training import FlatStep

            mp = self.trainer.mp
            quantization = self.trainer.config.quantization

            def score(model, batch):
                model = quantize(mp.cast_to_compute(model), quantization)
                kwargs = {"pos_ids": batch["positions"]} if model.absolute_positions else {}
                hidden = model.activations(batch["tokens"], batch["segment_ids"], **kwargs)
                Batch, Pos = batch["tokens"].axes
                h = hidden.rearrange((Batch.name, Pos.name, model.Embed.name)).array
                head = model.get_lm_head().rearrange((model.Vocab.name, model.Embed.name)).array
                targets = batch["targets"].array

                def one_row(args):
                    # One row's logits at a time: [positions, vocab], never the batch's.
                    hr, tr = args
                    logits = jnp.einsum("pe,ve->pv", hr, head, preferred_element_type=jnp.float32)
                    log_z = jax.nn.logsumexp(logits, axis=-1)
                    target = jnp.take_along_axis(logits, tr[:, None], axis=-1)[:, 0]
                    return target - log_z, jnp.argmax(logits, axis=-1) == tr

                logprobs, greedy = jax.lax.map(one_row, (h, targets))
                return hax.named(logprobs, (Batch, Pos)), hax.named(greedy, (Batch, Pos))

            named = hax.named_jit(score, axis_resources=self.trainer.compute_mapping)
            self._fn = FlatStep(score, named, self.trainer.param_mapping, donate=False)
        return self._fn

    def score(self, packed: PackedRequests) -> Tuple[np.ndarray, np.ndarray]:
        """``(logprobs, greedy)``, ``[rows, length]`` numpy arrays on every process, of ``packed`` (padded
        here to whole batches)."""
        from jax.experimental import multihost_utils
        from jax.sharding import NamedSharding, PartitionSpec

        rows = packed.num_rows
        packed = packed.padded_to(self.batch_size)
        fn = self._compiled()
        mesh = self.trainer.mesh
        sharding = NamedSharding(mesh, PartitionSpec("data", None))
        Batch = hax.Axis(self.batch_axis, self.batch_size)
        Pos = hax.Axis("position", self.length)
        out_lp, out_greedy = [], []
        pending = None
        for start in range(0, packed.num_rows, self.batch_size):
            host = {name: getattr(packed, name)[start:start + self.batch_size]
                    for name in ("tokens", "targets", "segment_ids", "positions")}
            batch = {name: hax.named(jax.make_array_from_callback(a.shape, sharding, lambda idx, a=a: a[idx]),
                                     (Batch, Pos)) for name, a in host.items()}
            with hax.partitioning.set_mesh(mesh), hax.axis_mapping(self.trainer.compute_mapping):
                out = fn(self.model, batch)
            if pending is not None:  # the previous batch is read once this one is dispatched
                _collect(pending, out_lp, out_greedy, multihost_utils)
            pending = out
        if pending is not None:
            _collect(pending, out_lp, out_greedy, multihost_utils)
        return np.concatenate(out_lp)[:rows], np.concatenate(out_greedy)[:rows]


def _collect(out, out_lp: list, out_greedy: list, multihost_utils) -> None:
    for named, dest in zip(out, (out_lp, out_greedy)):
        x = named.array
        dest.append(np.asarray(x) if x.is_fully_addressable else np.asarray(multihost_utils.process_allgather(x, tiled=True)))


def _on_mesh(trainer, model):
    """``model`` with every array on the trainer's mesh (placed by the parameter mapping when it is not)."""
    mesh_devices = set(trainer.mesh.devices.flat)
    arrays = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    if all(isinstance(x, jax.Array) and set(x.sharding.device_set) == mesh_devices for x in arrays):
        return model
    with hax.partitioning.set_mesh(trainer.mesh):
        return hax.shard(model, trainer.param_mapping)


class LevanterHarnessLM(TemplateLM):
    """An ``lm_eval.api.model.LM`` scoring requests with ``scorer`` (a :class:`RowScorer`) and encoding text
    with ``tokenizer`` (a levanter tokenizer: ``encode_batch``, ``eos_token_id``, ``bos_token_id``)."""

    def __init__(self, scorer: RowScorer, tokenizer, *, max_segments: int = 64):
        super().__init__()
        self.scorer = scorer
        self.levanter_tokenizer = tokenizer
        self.max_segments = max_segments
        self._hf_tokenizer = None
        if tokenizer.eos_token_id is None and tokenizer.bos_token_id is None:
            raise ValueError(
                f"tokenizer {tokenizer.name!r} has neither an EOS nor a BOS token: the harness "
                "conditions a document's first token on one of them"
            )

    # -- what the harness asks of a model ---------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.levanter_tokenizer.eos_token_id
        return eos if eos is not None else self.levanter_tokenizer.bos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.levanter_tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.scorer.length

    @property
    def tokenizer_name(self) -> str:
        return str(self.levanter_tokenizer.name).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> List[int]:
        if add_special_tokens:
            raise ValueError("levanter's harness model encodes text without special tokens")
        return [int(t) for t in self.levanter_tokenizer.encode_batch([string])[0]]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> List[Tuple[float, bool]]:
        return self.score_tokens([(ctx, cont) for _, ctx, cont in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        windows: List[Tuple[List[int], List[int]]] = []
        owner: List[int] = []
        for i, req in enumerate(requests):
            (text,) = req.args
            for pair in lm_eval_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1,
            ):
                windows.append(lm_eval_utils.make_disjoint_window(pair))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self.score_tokens(windows)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        tasks = sorted({getattr(r, "task_name", None) or "?" for r in requests})
        raise GenerationRefused(
            f"eval_harness.task_spec: task {', '.join(map(repr, tasks))} generates text (generate_until), which "
            "levanter does not evaluate (it scores log-likelihoods): remove it from task_spec"
        )

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        template = self.levanter_tokenizer.chat_template
        backend = self.levanter_tokenizer.backend
        if not template or backend is None:
            raise ValueError(
                f"eval_harness.apply_chat_template is set but tokenizer {self.tokenizer_name!r} has no chat template "
                "(chat_template in its tokenizer_config.json): unset apply_chat_template"
            )
        if self._hf_tokenizer is None:
            from transformers import PreTrainedTokenizerFast

            self._hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
        return self._hf_tokenizer.apply_chat_template(chat_history, tokenize=False, chat_template=template,
                                                      add_generation_prompt=add_generation_prompt)

    @property
    def chat_template(self):  # what the harness records of the template (a property in lm_eval's LM)
        return self.levanter_tokenizer.chat_template or ""

    # -- scoring ------------------------------------------------------------------------------------------
    def score_tokens(self, requests: Sequence[Tuple[Sequence[int], Sequence[int]]]) -> List[Tuple[float, bool]]:
        """``(summed log-probability, greedy)`` of each ``(context tokens, continuation tokens)``."""
        if not requests:
            return []
        packed = pack_requests(requests, self.max_length, max_segments=self.max_segments)
        if packed.truncated:
            logger.info("%d of %d requests were longer than %d tokens: their contexts were cut from the left",
                        packed.truncated, len(requests), self.max_length)
        _check_same_requests(packed)
        logprobs, greedy = self.scorer.score(packed)
        return packed.results(logprobs, greedy)


def _check_same_requests(packed: PackedRequests) -> None:
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
