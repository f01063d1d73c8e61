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

Token requests are scored by :func:`levanter.eval_harness.scoring.score_requests`: packed several to a
row (:mod:`levanter.eval_harness.packing`), rows batched ``batch_size`` at a time, and one compiled
program per evaluation length returns every position's log-probability and greedy flag. The packing is a
pure function of the set of requests, so in a multi-process job every process builds the same batches
and takes part in each; the processes check that they were handed the same requests (a hash compared
across processes) before the first batch.

The prefix token is the tokenizer's BOS, else its EOS (the Hugging Face backend's choice); tokens are
encoded without special tokens (that backend's default for causal models).

Importing this module imports ``lm_eval`` (the ``eval`` extra): the rest of levanter imports it only
when a harness evaluation runs.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from lm_eval import utils as lm_eval_utils
from lm_eval.api.model import TemplateLM

from levanter.eval_harness.scoring import RowScorer, score_requests

__all__ = ["LevanterHarnessLM", "GenerationRefused"]


class GenerationRefused(ValueError):
    """A task asked the model to generate text (``generate_until``), which is not built."""


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
        return score_requests(self.scorer, requests, max_segments=self.max_segments)
