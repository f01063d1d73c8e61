"""The data-schedule record stored in checkpoints, and the first step at which two records differ.

A checkpoint at step ``k`` records everything that determines the data (sources and their cache
contents, stages, batch sizes, seeds, sequence length, shuffling, block size). On resume the current
config's record is compared with it: an edit that changes the data of some step ``< k`` would make the
resumed run's past disagree with what the checkpointed model actually saw, so it is refused with the
first step at which the two schedules differ (a stage or batch-size segment start, the first step of a
stage drawing a changed source, or 0 for the global settings) and what changed; edits that only touch
steps ``>= k`` are accepted and logged.

The comparison relies on the mixture's layout rule: data before a stage switch never depends on where
(or whether) a later switch happens, so the first differing step is where the effective stage, the
batch size, or a drawn source's content first differs.
"""

from __future__ import annotations

import json
from fractions import Fraction
from typing import Optional

from ..schedule import BatchSchedule, StepSchedule

__all__ = ["RECORD_FORMAT", "GLOBAL_KEYS", "CONFIG_KEYS", "data_schedule_record", "first_difference"]

RECORD_FORMAT = 1
GLOBAL_KEYS = ("format", "seq_len", "data_seed", "shuffle", "block_size", "stop_strategy", "enforce_eos")
# The config key that sets each global entry, so that a refused resume says what to put back.
CONFIG_KEYS = {
    "seq_len": "model.seq_len",
    "shuffle": "data.shuffle",
    "block_size": "data.mixture_block_size",
    "stop_strategy": "data.stop_strategy",
    "enforce_eos": "data.enforce_eos",
}


def _changed(key: str, old, new) -> str:
    """What changed in a global entry, in config terms, with the value that resumes as trained."""
    if key == "data_seed":  # the record holds the derived seed: its numbers would mean nothing to a user
        return "the data order's seed changed (data_seed, or trainer.seed when data_seed is null)"
    if key not in CONFIG_KEYS:
        return f"{key} changed from {old!r} to {new!r}"
    name, was = CONFIG_KEYS[key], json.dumps(old)
    return f"{name} changed from {was} to {json.dumps(new)} (the run was trained with {name}: {was})"


def _normalized(weights: dict) -> dict:
    total = sum(Fraction(w) for w in weights.values())
    return {k: float(Fraction(w) / total) for k, w in sorted(weights.items()) if w > 0}


def data_schedule_record(data_config, schedule: BatchSchedule, *, seq_len: int, data_seed: int) -> dict:
    """The JSON-able record of what determines the data (builds nothing: caches must exist)."""
    from .config import LMMixtureDatasetConfig

    if isinstance(data_config, LMMixtureDatasetConfig):
        caches = data_config.build_caches("train")
        stages = [[int(s), _normalized(m)] for s, m in data_config.stages()]
        order = [n for n in data_config.configs if n in caches]
        block_size = data_config.mixture_block_size
        stop = data_config.stop_strategy
    else:
        caches = {"": data_config.build_caches("train")}
        stages = [[0, {"": 1.0}]]
        order = [""]
        block_size, stop = None, None
    sources = {
        name: {
            "rows": c.ledger.total_rows,
            "tokens": c.ledger.total_tokens,
            "tokenizer": c.metadata.get("tokenizer", {}).get("hash"),
            "urls": c.metadata.get("urls"),
            "embedded": c.metadata.get("embedded"),
        }
        for name, c in caches.items()
    }
    return {
        "format": RECORD_FORMAT,
        "seq_len": int(seq_len),
        "data_seed": int(data_seed),
        "shuffle": data_config.shuffle,
        "block_size": block_size,
        "stop_strategy": stop,
        "enforce_eos": data_config.enforce_eos,
        "source_order": order,
        "sources": sources,
        "batch_schedule": [[seg.start, seg.value] for seg in schedule.segments],
        "stages": stages,
    }


def _stage_schedule(stages: list) -> StepSchedule[dict]:
    """A record's ``stages`` as a step schedule of normalised weights."""
    return StepSchedule(((start, _normalized(weights)) for start, weights in stages), name="stages")


def first_difference(old: dict, new: dict) -> Optional[tuple[int, str]]:
    """``(first step whose data differs, what changed)``, or None if the records agree on every step."""
    found: list[tuple[int, str]] = []
    for key in GLOBAL_KEYS:
        if old.get(key) != new.get(key):
            found.append((0, _changed(key, old.get(key), new.get(key))))
    old_order = [n for n in old.get("source_order", []) if n in new.get("source_order", [])]
    new_order = [n for n in new.get("source_order", []) if n in old.get("source_order", [])]
    if old_order != new_order:
        found.append((0, f"the order of sources changed from {old_order} to {new_order}"))

    def first_drawn(name: str) -> Optional[int]:
        steps = [s for rec in (old, new) for s, w in rec.get("stages", []) if w.get(name, 0) > 0]
        return min(steps) if steps else None

    old_src, new_src = old.get("sources", {}), new.get("sources", {})
    for name in sorted(set(old_src) | set(new_src)):
        if old_src.get(name) != new_src.get(name):
            step = first_drawn(name)
            if step is not None:
                if name not in old_src:
                    what = "added"
                else:
                    what = "removed" if name not in new_src else "changed its data"
                found.append((step, f"source {name!r} {what}"))

    old_bs, new_bs = BatchSchedule(old["batch_schedule"]), BatchSchedule(new["batch_schedule"])
    for s in sorted({seg.start for seg in old_bs.segments} | {seg.start for seg in new_bs.segments}):
        a, b = old_bs.batch_size_at_step(s), new_bs.batch_size_at_step(s)
        if a != b:
            found.append((s, f"the batch size at step {s} changed from {a} to {b}"))
            break

    old_st, new_st = _stage_schedule(old.get("stages", [])), _stage_schedule(new.get("stages", []))
    for s in sorted(set(old_st.starts) | set(new_st.starts)):
        a, b = old_st.entry_at(s), new_st.entry_at(s)
        if a != b:
            what = f"the mixture at step {s} changed from stage {list(a)} to {list(b)} (start, weights)"
            found.append((s, what))
            break
    return min(found) if found else None
