"""Packing the lm-evaluation-harness's requests into rows (levanter.eval_harness.packing) and the
``eval_harness`` config's checks: no harness needed (these run without the ``eval`` extra).

The packed rows are scored here by a bigram "model" (the log-probability of a token depends only on the one
before it), whose answer for a request can be computed straight from the request's tokens: the packed
scoring must agree with it, whatever order the requests come in."""

from __future__ import annotations

import random

import numpy as np
import pytest

from levanter.eval_harness.config import LmEvalHarnessConfig, TaskConfig
from levanter.eval_harness.packing import PAD_SEGMENT, pack_requests

VOCAB = 17


def bigram(seed=0):
    table = np.random.default_rng(seed).normal(size=(VOCAB, VOCAB))
    return table - np.log(np.exp(table).sum(axis=1, keepdims=True))  # log-softmax per previous token


def direct(table, context, continuation, length):
    """The request's answer computed from its tokens, with the harness's truncation rule."""
    whole = (list(context) + list(continuation))[-(length + 1):]
    n = len(continuation)
    ll = sum(table[whole[j - 1], whole[j]] for j in range(len(whole) - n, len(whole)))
    greedy = all(int(np.argmax(table[whole[j - 1]])) == whole[j] for j in range(len(whole) - n, len(whole)))
    return ll, greedy


def random_requests(rng, count, length):
    out = []
    for _ in range(count):
        ctx = [rng.randrange(VOCAB) for _ in range(rng.randint(1, length + 8))]  # some longer than a row
        cont = [rng.randrange(VOCAB) for _ in range(rng.randint(1, min(6, length)))]
        out.append((ctx, cont))
    return out + out[:5]  # repeated requests are scored once


def score(packed, table):
    logprobs = table[packed.tokens, packed.targets].astype(np.float32)
    greedy = np.argmax(table[packed.tokens], axis=-1) == packed.targets
    return packed.results(logprobs, greedy)


def test_packed_scores_equal_each_request_scored_alone_in_any_order():
    rng = random.Random(0)
    table = bigram()
    length = 24
    requests = random_requests(rng, 60, length)
    packed = pack_requests(requests, length, max_segments=5)
    got = score(packed, table)
    for (ctx, cont), (ll, greedy) in zip(requests, got):
        want_ll, want_greedy = direct(table, ctx, cont, length)
        assert ll == pytest.approx(want_ll, rel=1e-5) and greedy == want_greedy
    assert packed.truncated == sum(len(c) + len(x) > length + 1 for c, x in requests)
    assert len(packed.spans) == len({(tuple(c), tuple(x)) for c, x in requests})  # duplicates packed once

    # The rows are a function of the set of requests: another order gives the same rows.
    shuffled = list(requests)
    random.Random(1).shuffle(shuffled)
    again = pack_requests(shuffled, length, max_segments=5)
    for name in ("tokens", "targets", "segment_ids", "positions", "scored"):
        np.testing.assert_array_equal(getattr(packed, name), getattr(again, name), err_msg=name)


def test_rows_hold_whole_requests_within_the_segment_limit():
    rng = random.Random(2)
    length = 16
    packed = pack_requests(random_requests(rng, 200, length), length, max_segments=3)
    for row in range(packed.num_rows):
        segs = packed.segment_ids[row]
        real = segs[segs != PAD_SEGMENT]
        assert len(set(real.tolist())) <= 3
        # each segment is contiguous, its positions count from 0, and padding only trails
        for s in set(real.tolist()):
            where = np.flatnonzero(segs == s)
            assert (np.diff(where) == 1).all()
            np.testing.assert_array_equal(packed.positions[row, where], np.arange(len(where)))
        if (segs == PAD_SEGMENT).any():
            assert (segs[np.argmax(segs == PAD_SEGMENT):] == PAD_SEGMENT).all()
    # first-fit-decreasing keeps padding low: most rows are more than half full
    fill = (packed.segment_ids != PAD_SEGMENT).mean(axis=1)
    assert np.median(fill) > 0.5
    padded = packed.padded_to(8)
    assert padded.num_rows % 8 == 0 and (padded.segment_ids[packed.num_rows:] == PAD_SEGMENT).all()


def test_a_continuation_longer_than_a_row_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="raise eval_harness.max_eval_length"):
        pack_requests([([1, 2], list(range(9)))], 8)


@pytest.mark.parametrize("config, message", [
    (LmEvalHarnessConfig(task_spec=[]), "eval_harness.task_spec is empty"),
    (LmEvalHarnessConfig(task_spec=["piqa", "piqa"]), "names 'piqa' twice: give one of them a task_alias"),
    (LmEvalHarnessConfig(task_spec=["hellaswag", TaskConfig(task="hellaswag", num_fewshot=10)]), "names 'hellaswag' twice"),
    (LmEvalHarnessConfig(task_spec=[TaskConfig(task="piqa", num_fewshot=-1)]), "task_spec.0.num_fewshot must be >= 0"),
    (LmEvalHarnessConfig(task_spec=["piqa"], max_examples=0), "eval_harness.max_examples must be >= 1"),
    (LmEvalHarnessConfig(task_spec=["piqa"], max_eval_length=1), "eval_harness.max_eval_length must be >= 2"),
])
def test_bad_harness_sections_name_the_key(config, message):
    with pytest.raises(ValueError, match=message):
        config.validate()


def test_upstream_task_entries_parse_and_become_the_harness_task_dicts(tmp_path):
    from levanter.config import parse_config
    from levanter.lm_config import TrainLmConfig, check_eval_harness

    path = tmp_path / "c.yaml"
    path.write_text("eval_harness:\n  task_spec:\n    - piqa\n    - task: hellaswag\n      task_alias: hellaswag_10shot\n"
                    "      num_fewshot: 10\n      doct_to_target: '{{label}}'\n  max_examples: 32\neval_harness_steps: 50\n"
                    "model: {type: gpt2, seq_len: 64}\n")
    config = parse_config(TrainLmConfig, str(path))
    check_eval_harness(config)
    assert config.eval_harness_steps == 50
    assert config.eval_harness.task_names() == ["piqa", "hellaswag_10shot"]
    assert config.eval_harness.to_task_spec() == [
        "piqa", {"task": "hellaswag", "task_alias": "hellaswag_10shot", "num_fewshot": 10, "doc_to_target": "{{label}}"}]
    too_long = TrainLmConfig(model=config.model, eval_harness=LmEvalHarnessConfig(task_spec=["piqa"], max_eval_length=65))
    with pytest.raises(ValueError, match=r"eval_harness.max_eval_length=65 exceeds what the model supports \(64"):
        check_eval_harness(too_long)


# Upstream's config/gpt2_small_fast_eval.yaml (its data on gs:// and the Hub): it parses and passes the checks
# that need no data; its tasks (PIQA, HellaSwag) then need the Hub.
GPT2_SMALL_FAST_EVAL = """\
data:
  configs:
    owt:
      train_urls:
        - "gs://pubmed-mosaic/openwebtext-sharded/openwebtext_train.{1..128}-of-128.jsonl.gz"
      validation_urls:
        - "gs://pubmed-mosaic/openwebtext-sharded/openwebtext_val.{1..8}-of-8.jsonl.gz"
    wikitext:
      id: dlwh/wikitext_103_detokenized
  train_weights:
    owt: 0.6
    wikitext: 0.4
  tokenizer: gpt2
  cache_dir: "gs://levanter-data/tokenized/data_mix"

eval_harness:
  task_spec: ["piqa", "hellaswag"]
  max_examples: 2048
eval_harness_steps: 1000

model:
  type: gpt2
  hidden_dim: 768
  num_heads: 12
  num_layers: 12
  seq_len: 1024
  gradient_checkpointing: true
  scale_attn_by_inverse_layer_idx: true
trainer:
  tracker:
    project: "levanter"
    tags: [ "openwebtext+wiki", "gpt2", "itest"]

  mp: p=f32,c=bfloat16
  model_axis_size: 1

  train_batch_size: 256
  num_train_steps: 20000
optimizer:
  learning_rate: 1E-3
  weight_decay: 0.1
  warmup: 0.01
"""


def test_upstream_gpt2_small_fast_eval_parses(tmp_path):
    from levanter.config import parse_config
    from levanter.lm_config import TrainLmConfig, check_eval_harness
    from levanter.refused_keys import check_refused

    path = tmp_path / "gpt2_small_fast_eval.yaml"
    path.write_text(GPT2_SMALL_FAST_EVAL)
    config = parse_config(TrainLmConfig, str(path))
    check_refused(config)
    check_eval_harness(config)
    assert config.eval_harness.task_spec == ["piqa", "hellaswag"] and config.eval_harness.max_examples == 2048
    assert config.eval_harness_steps == 1000


def test_aliases_rename_a_group_and_its_subtasks_and_averages_weight_by_documents():
    from levanter.eval_harness.run import compute_averages, harness_metrics, rename_results

    report = {
        "results": {"mmlu": {"acc,none": 0.5, "alias": "mmlu"}, "mmlu_anatomy": {"acc,none": 0.25},
                    "mmlu_law": {"acc,none": 0.75, "acc_stderr,none": "N/A"}},
        "n-samples": {"mmlu_anatomy": {"effective": 30}, "mmlu_law": {"effective": 10}},
        "group_subtasks": {"mmlu": ["mmlu_anatomy", "mmlu_law"]},
    }
    renamed = rename_results(report, "mmlu", "mmlu_1shot")
    assert sorted(renamed["results"]) == ["mmlu_1shot", "mmlu_anatomy_1shot", "mmlu_law_1shot"]
    assert renamed["group_subtasks"] == {"mmlu_1shot": ["mmlu_anatomy_1shot", "mmlu_law_1shot"]}
    assert sorted(rename_results({"results": {"hellaswag": {}}}, "hellaswag", "hs10")["results"]) == ["hs10"]
    assert rename_results(report, "mmlu", "mmlu") is report

    averages = compute_averages(renamed)  # over the subtasks, which have documents; the group has none
    assert averages["macro_avg_acc,none"] == pytest.approx((0.25 + 0.75) / 2)
    assert averages["micro_avg_acc,none"] == pytest.approx((0.25 * 30 + 0.75 * 10) / 40)
    metrics = harness_metrics({**renamed, "averages": averages})
    assert metrics["lm_eval/mmlu_law_1shot/acc"] == 0.75 and "lm_eval/mmlu_law_1shot/acc_stderr" not in metrics
    assert metrics["lm_eval/averages/micro_avg_acc"] == pytest.approx(0.375)
