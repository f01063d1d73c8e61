#!/usr/bin/env python
"""Benchmark: lm-evaluation-harness scoring on one TPU chip (requests per second, padded share, compile).

The code path a run's ``eval_harness:`` section takes from token requests to answers
(:func:`levanter.eval_harness.scoring.score_requests`: packing, the check that every process packed the same
rows, the compiled scoring program batch by batch, the answers read back), on the 350M bench model
(``config/bench/llama_350m_tpu.yaml``, randomly initialised: the speed does not depend on the weights), rows
of ``model.seq_len`` positions, ``trainer.eval_batch_size`` rows a batch, as training's harness uses them.
The harness itself (``lm_eval``) is not needed: what it adds before that point is turning the tasks'
documents into ``(context, continuation)`` strings and those into tokens.

The requests are shaped like a multiple-choice benchmark's: ``--requests`` loglikelihood requests, ``--choices``
per question sharing the question's context. Contexts are ``--context-tokens`` (uniform, default 50 to 400)
tokens of real text (the embedded corpus's validation documents through the bench tokenizer,
``tokenizers/bench-bpe-32k``, trained here if missing as ``scripts/bench/tpu.py`` does); the first choice is
the text that follows, the others text from elsewhere, each ``--continuation-tokens`` long (default 1 to 24).

Reported (last line JSON, also ``--json PATH``):

* **compile_s**: the scoring program compiled ahead of the first batch (a cold compile unless
  ``JAX_COMPILATION_CACHE_DIR`` names a cache that holds it);
* **first_batch_s**: the first batch after the compile (warm-up; not in the rates);
* **requests_per_s**: requests over the median of ``--repeats`` whole passes of ``score_requests`` over
  every request (packing, transfers, scoring, reading back), after the compile and the first batch;
  **tokens_per_s**: the requests' tokens (context + continuation, each distinct request once) at that rate;
* **padded_share**: of the positions the batches compute (rows x length, rows added to fill the last batch
  included), the share holding no request token; **padded_share_in_rows**: the same over the packed rows only;
* **forward_mfu**: the model's forward FLOPs (``flops_per_token`` / 3) for every position computed, padding
  included, per second, over the chip's peak.

Every pass must give the same answers bit for bit (checked). Usage (on the TPU host, from the project root;
~100 s of compile cold, a few seconds of scoring)::

    bash .tpu-bundle/run.sh python scripts/bench/eval_harness.py --requests 2000 --json $OUT/harness.json
    python scripts/bench/eval_harness.py -- --trainer.per_device_eval_parallelism 32   # config overrides

``--allow-cpu`` runs on CPU with a two-layer model of width 64, rows of 512 and 200 requests (to check the
script, not to measure).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import note_load_average, parser, write_json  # noqa: E402 -- after the path insert above
from tpu import REPO, ensure_tokenizer  # noqa: E402

CONFIG = "config/bench/llama_350m_tpu.yaml"
# --allow-cpu: the bench model's shape, small enough for a CPU.
CPU_OVERRIDES = ["--model.hidden_dim", "64", "--model.intermediate_dim", "176", "--model.num_layers", "2",
                 "--model.num_heads", "4", "--model.num_kv_heads", "2", "--model.seq_len", "512",
                 "--model.attn_backend", "vanilla", "--trainer.require_accelerator", "false"]
CORPUS = [("python-docs", "validation"), ("python-code", "validation")]


def make_requests(tokenizer, count: int, choices: int, context: tuple, continuation: tuple, seed: int) -> list:
    """``count`` ``(context tokens, continuation tokens)`` requests, ``choices`` per question."""
    import numpy as np

    from levanter.ingest.embedded import iter_embedded_documents

    texts = [d["text"] for name, split in CORPUS for d in iter_embedded_documents(name, split)]
    stream = np.concatenate([np.asarray(t, np.int32) for t in tokenizer.encode_batch(texts)])
    rng = np.random.default_rng(seed)
    room = len(stream) - context[1] - 2 * continuation[1]
    if room <= 0:
        raise SystemExit(f"error: the corpus has {len(stream)} tokens, too few for contexts of {context[1]}")
    out = []
    while len(out) < count:
        n = int(rng.integers(context[0], context[1] + 1))
        start = int(rng.integers(0, room))
        ctx = stream[start:start + n].tolist()
        for c in range(choices):
            m = int(rng.integers(continuation[0], continuation[1] + 1))
            at = start + n if c == 0 else int(rng.integers(0, room))  # the text that follows, else elsewhere
            out.append((ctx, stream[at:at + m].tolist()))
    return out[:count]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--requests", type=int, help="loglikelihood requests (default 2000; --allow-cpu 200)")
    p.add_argument("--choices", type=int, default=4, help="requests per question, sharing its context")
    p.add_argument("--context-tokens", type=int, nargs=2, default=(50, 400), metavar=("MIN", "MAX"))
    p.add_argument("--continuation-tokens", type=int, nargs=2, default=(1, 24), metavar=("MIN", "MAX"))
    p.add_argument("--repeats", type=int, default=3, help="timed passes over every request (median reported)")
    p.add_argument("--max-segments", type=int, default=64, help="requests a row at most (the harness model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default=CONFIG, help="the training config whose model and trainer are used")
    p.add_argument("--json", help="also write the result here")
    p.add_argument("--allow-cpu", action="store_true", help="run a small model on CPU (checks the script)")
    argv = sys.argv[1:]
    overrides = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    args = p.parse_args(argv)
    if args.requests is None:
        args.requests = 200 if args.allow_cpu else 2000
    if args.requests < 1 or args.choices < 1 or args.repeats < 1 or not (
            1 <= args.context_tokens[0] <= args.context_tokens[1]) or not (
            1 <= args.continuation_tokens[0] <= args.continuation_tokens[1]):
        p.error("--requests, --choices, --repeats and the token ranges must be positive (MIN <= MAX)")

    import haliax as hax
    import jax
    import numpy as np

    import levanter.config
    from levanter.eval_harness.packing import PAD_SEGMENT, pack_requests
    from levanter.eval_harness.scoring import RowScorer, score_requests
    from levanter.lm_config import TrainLmConfig, model_vocab_size
    from levanter.run.eval_model import eval_trainer
    from levanter.utils.flops import peak_flops_per_device

    platform = jax.default_backend()
    if platform != "tpu" and not args.allow_cpu:
        print(f"error: this benchmark measures a TPU; jax's backend here is {platform!r} (--allow-cpu runs a small "
              "model on CPU to check the script)", file=sys.stderr)
        sys.exit(2)
    os.chdir(REPO)  # the config's relative paths (the tokenizer) are the project's
    ensure_tokenizer()
    cpu = CPU_OVERRIDES if platform != "tpu" else []
    config = levanter.config.parse_config(TrainLmConfig, args.config, [*cpu, *overrides])
    tcfg = config.trainer
    tcfg.apply_jax_config()
    tokenizer = config.data.the_tokenizer()
    vocab = model_vocab_size(config, tokenizer)
    length = config.model.seq_len
    if args.context_tokens[1] + args.continuation_tokens[1] > length + 1:
        print(f"# note: requests up to {args.context_tokens[1] + args.continuation_tokens[1]} tokens are "
              f"cut to rows of {length} (the harness's rule)", file=sys.stderr)

    t0 = time.perf_counter()
    requests = make_requests(tokenizer, args.requests, args.choices, tuple(args.context_tokens),
                             tuple(args.continuation_tokens), args.seed)
    requests_s = time.perf_counter() - t0

    trainer = eval_trainer(tcfg)
    state = trainer.initial_state(lambda k: config.model.build(hax.Axis("vocab", vocab), key=k),
                                  key=jax.random.PRNGKey(0))
    batch_rows = tcfg.eval_batch_size
    scorer = RowScorer(trainer, state.model, batch_size=batch_rows, length=length, batch_axis=tcfg.batch_axis)
    del state

    t0 = time.perf_counter()
    packed = pack_requests(requests, length, max_segments=args.max_segments)
    pack_s = time.perf_counter() - t0
    padded = packed.padded_to(batch_rows)
    used = int((packed.segment_ids != PAD_SEGMENT).sum())
    first = scorer.device_batch(padded, 0)

    if platform != "tpu":
        note_load_average()
    t0 = time.perf_counter()
    scorer.compile(first)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(scorer.run(first))
    first_batch_s = time.perf_counter() - t0

    passes, answers = [], None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        got = score_requests(scorer, requests, max_segments=args.max_segments)
        passes.append(time.perf_counter() - t0)
        if answers is not None and got != answers:
            raise SystemExit("error: two passes over the same requests gave different answers")
        answers = got
    if not all(np.isfinite(ll) for ll, _ in answers):
        raise SystemExit("error: a log-likelihood is not finite")

    pass_s = statistics.median(passes)
    positions = padded.num_rows * length
    peak = peak_flops_per_device(jax.devices()[0])
    forward_flops = config.model.flops_per_token(vocab) / 3 * positions
    result = {
        "benchmark": "eval_harness", "platform": platform, "device": jax.devices()[0].device_kind,
        "config": args.config, "overrides": [*cpu, *overrides], "length": length, "batch_rows": batch_rows,
        "requests": len(requests), "choices": args.choices, "distinct_requests": len(packed.spans),
        "context_tokens": list(args.context_tokens), "continuation_tokens": list(args.continuation_tokens),
        "request_tokens": used, "rows": packed.num_rows, "batches": padded.num_rows // batch_rows,
        "padded_share": 1 - used / positions, "padded_share_in_rows": 1 - used / (packed.num_rows * length),
        "truncated": packed.truncated,
        "compile_s": compile_s, "first_batch_s": first_batch_s, "pass_s": pass_s, "passes_s": passes,
        "requests_per_s": len(requests) / pass_s, "tokens_per_s": used / pass_s,
        "forward_mfu": forward_flops / pass_s / peak if peak else None,
        "pack_s": pack_s, "make_requests_s": requests_s,
        "compilation_cache": os.environ.get("JAX_COMPILATION_CACHE_DIR"),
    }
    print(f"{result['requests']} requests ({result['distinct_requests']} distinct, {args.choices} a question) in "
          f"{result['rows']} rows of {length} ({result['batches']} batches of {batch_rows}) on {result['device']}")
    print(f"compile {compile_s:.1f} s, first batch {first_batch_s:.2f} s; a pass {pass_s:.2f} s (median of "
          f"{len(passes)}): {result['requests_per_s']:.1f} requests/s, {result['tokens_per_s']:,.0f} tokens/s"
          + (f", forward MFU {result['forward_mfu']:.1%}" if result["forward_mfu"] else ""))
    print(f"padded positions {result['padded_share']:.1%} ({result['padded_share_in_rows']:.1%} within the "
          f"packed rows); packing {pack_s:.2f} s")
    write_json(args.json, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
