#!/usr/bin/env python
"""Helper for ``run_all.py``: upstream Levanter's loader on the same synthetic corpus. Run it with the
*upstream* venv's Python (``scripts/bench/setup_upstream_venv.sh``); it prints one JSON object.

``write ROOT TOTAL_TOKENS TOKENIZER_DIR`` writes the three sources of ``_synthetic.py`` into
``ROOT/<name>/train`` in upstream's cache format with upstream's own ``SerialCacheWriter`` (no Ray):
one row per document, the fields of the byte tokenizer's output exemplar (``input_ids`` plus whatever
else it returns, zero-filled), and a finished ledger. The tokens are the ones our side caches.

``all WORK SPEC_JSON`` does what ``run_all.py`` needs in one process (see :func:`run_all_steps`).

``measure ROOT TOKENIZER_DIR SPEC_JSON`` builds the dataset the way upstream's ``train_lm`` does --
``LMMixtureDatasetConfig(configs={name: {cache_dir}}, train_weights=<the 2 stages>, shuffle=True,
mixture_block_size=2048).train_set(Pos, BatchSchedule(B), key=PRNGKey(0))`` (no URLs, so the caches are
loaded, never rebuilt) -- and reads it with ``DataLoader(..., prefetch_size=32, max_buffered_batches=128)``
on a one-device ``("data", "model")`` mesh, the settings of upstream's ``Trainer.data_loader``. It then
times, for each ``[batch, n, seq_len]`` in ``throughput``: tokens/s over the ``n`` batches after the first, from
the step where ours starts (straddling the stage switch), each batch ``block_until_ready``; and for
each step in ``ttfb_steps``: a fresh ``train_set`` + ``DataLoader`` ("build"), then
``iter_from_step(k)`` to the first ready batch. The first loader of the process is reported separately
as the cold time to first batch (it includes upstream's first-use jit of the example map).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _synthetic as syn  # noqa: E402


def load_tokenizer(tokenizer_dir: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert tok.eos_token_id == syn.EOS and len(tok) == syn.VOCAB, "tokenizer ids differ from _synthetic"
    return tok


def write_source(cache_dir: str, index: int, n_tokens: int, tokenizer_dir: str) -> int:
    """Source ``index`` of the synthetic corpus as a finished upstream cache at ``cache_dir``; its tokens."""
    import numpy as np
    from levanter.data.text import BatchTokenizer
    from levanter.store.cache import CacheMetadata, SerialCacheWriter

    processor = BatchTokenizer(load_tokenizer(tokenizer_dir), enforce_bos=True, enforce_eos=True)
    exemplar = processor.output_exemplar
    flat, lengths = syn.source_tokens(index, n_tokens)
    docs = np.split(flat, np.cumsum(lengths)[:-1])
    rows = [{f: (d if f == "input_ids" else np.zeros_like(d)) for f in exemplar} for d in docs]
    with SerialCacheWriter(cache_dir, exemplar, CacheMetadata(processor.metadata)) as w:
        for i in range(0, len(rows), 1024):
            w.write_batch(rows[i : i + 1024])
    return int(lengths.sum())


def write(root: str, total_tokens: int, tokenizer_dir: str) -> dict:
    """The three sources into ``root/<name>/train``; returns per-source token counts."""
    return {
        name: write_source(os.path.join(root, name, "train"), k, n, tokenizer_dir)
        for k, (name, n) in enumerate(syn.source_sizes(total_tokens).items())
    }


def write_single(cache_dir: str, total_tokens: int, tokenizer_dir: str) -> dict:
    """Source 0 of the synthetic corpus as one cache at ``cache_dir`` (the training comparison's data)."""
    return {"tokens": write_source(cache_dir, 0, total_tokens, tokenizer_dir)}


def make_loader(root: str, tokenizer_dir: str, batch_size: int, seq_len: int = syn.SEQ_LEN):
    import haliax as hax
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from levanter.data.loader import DataLoader
    from levanter.data.text import LMMixtureDatasetConfig
    from levanter.schedule import BatchSchedule

    cfg = LMMixtureDatasetConfig(
        tokenizer=tokenizer_dir,
        configs={name: {"cache_dir": os.path.join(root, name)} for name in syn.SOURCES},
        train_weights=[(s, dict(w)) for s, w in syn.STAGES],
        shuffle=True,
        mixture_block_size=2048,
    )
    cfg = _as_config(cfg)
    Pos = hax.Axis("position", seq_len)
    ds = cfg.train_set(Pos, BatchSchedule(batch_size), monitors=False, key=jax.random.PRNGKey(0))
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(-1, 1), ("data", "model"))
    return DataLoader(
        ds, batch_size, mesh=mesh, axis_resources={"batch": "data"}, batch_axis_name="batch",
        prefetch_size=32, max_buffered_batches=128,
    )


def _as_config(cfg):
    """draccus-free construction: turn the per-source dicts into upstream's source config objects."""
    import dataclasses

    from levanter.data.text import UrlDatasetSourceConfig

    configs = {k: (UrlDatasetSourceConfig(**v) if isinstance(v, dict) else v) for k, v in cfg.configs.items()}
    return dataclasses.replace(cfg, configs=configs)


def stop(it) -> None:
    """Stop an upstream iterator's background producer; otherwise it keeps filling its 128-batch buffer
    and steals the CPU from the next measurement."""
    bg = getattr(it, "_batches", None)
    if hasattr(bg, "stop"):
        bg.stop(wait=True)


def first_step(n: int) -> int:
    return max(0, syn.STAGE_SWITCH_STEP - n // 2)


def measure(root: str, tokenizer_dir: str, spec: dict) -> dict:
    import jax

    out: dict = {"throughput": [], "ttfb": []}
    load_tokenizer(tokenizer_dir)
    # Cold: the first loader in this process.
    t0 = time.perf_counter()
    loader = make_loader(root, tokenizer_dir, spec["ttfb_batch"])
    t1 = time.perf_counter()
    it = iter(loader.iter_from_step(0))
    jax.block_until_ready(next(it))
    out["cold"] = {"build_s": t1 - t0, "first_batch_s": time.perf_counter() - t1}
    stop(it)

    for bs, n, seq_len in spec["throughput"]:
        loader = make_loader(root, tokenizer_dir, bs, seq_len)
        start = first_step(n)
        it = iter(loader.iter_from_step(start))
        jax.block_until_ready(next(it))
        t0 = time.perf_counter()
        for _ in range(n):
            jax.block_until_ready(next(it))
        dt = time.perf_counter() - t0
        out["throughput"].append({"batch": bs, "n": n, "seq_len": seq_len, "tokens_per_s": n * bs * seq_len / dt})
        stop(it)

    for rep in range(spec.get("ttfb_repeats", 1)):
        for step in spec["ttfb_steps"]:
            it = None
            try:
                t0 = time.perf_counter()
                loader = make_loader(root, tokenizer_dir, spec["ttfb_batch"])
                t1 = time.perf_counter()
                it = iter(loader.iter_from_step(step))
                jax.block_until_ready(next(it))
                out["ttfb"].append({"step": step, "build_s": t1 - t0, "first_batch_s": time.perf_counter() - t1})
            except Exception as e:  # noqa: BLE001 -- reported, e.g. an index overflow at huge steps
                out["ttfb"].append({"step": step, "error": f"{type(e).__name__}: {e}"[:300]})
            finally:
                if it is not None:
                    stop(it)
    return out


def run_all_steps(work: str, spec: dict) -> dict:
    """Everything ``run_all.py`` needs from upstream's venv in one process (its imports take seconds):
    the offline tokenizer + fake HF cache (``upstream_train.prepare``), the loader caches, the training
    cache, and the loader measurements, each if asked for in ``spec``."""
    import upstream_train

    out: dict = {}
    prep_dir = os.path.join(work, "prep")
    upstream_train.prepare(prep_dir)
    out["prep"] = prep = {"tokenizer": os.path.join(prep_dir, "tokenizer"), "hf_home": os.path.join(prep_dir, "hf_home")}
    if spec.get("train_cache"):
        path, tokens = spec["train_cache"]
        out["train_cache"] = write_single(path, tokens, prep["tokenizer"])
    if spec.get("loader"):
        root = os.path.join(work, "upstream-cache")
        write(root, spec["loader"]["tokens"], prep["tokenizer"])
        out["loader"] = [measure(root, prep["tokenizer"], spec["loader"]) for _ in range(spec["loader"].get("repeats", 1))]
    return out


def main(argv: list[str]) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    cmd = argv[0]
    if cmd == "write":
        result = write(argv[1], int(argv[2]), argv[3])
    elif cmd == "write-single":
        result = write_single(argv[1], int(argv[2]), argv[3])
    elif cmd == "all":
        result = run_all_steps(argv[1], json.loads(argv[2]))
    elif cmd == "measure":
        result = measure(argv[1], argv[2], json.loads(argv[3]))
    else:
        raise SystemExit(f"unknown command {cmd!r}: expected write or measure")
    sys.stdout.write("\nRESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    # Upstream's background loader threads can abort the interpreter at exit ("terminate called after
    # throwing an instance of ''"); the result is already out, so leave without running finalizers.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
