#!/usr/bin/env python
"""The reported early-switch experiment, end to end: two train_lm runs identical except where stage 2
of a two-source curriculum starts (80% vs 90% of training), compared step by step.

Upstream Levanter issue #876 reported two such runs parting slightly *before* the earlier switch. Here
the runs must agree bit for bit -- per-step ``train/loss`` and ``data/fingerprint`` -- on every step
before the 80% step, and run A's batches must take the stage-2 composition exactly at that step.

Variants: ``constant`` (fixed batch size), ``batch_schedule`` (the batch size changes before the switch)
and ``grad_accum`` (microbatched steps). Each prints the first differing step of the losses, the
fingerprints and the source counts, and the first step at which run A draws stage-2 composition.

    python scripts/curriculum_experiment.py                 # the shipped curriculum config, shrunk
    python scripts/curriculum_experiment.py --quick --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_config(base, *, run_id, workdir, steps, switch, variant, model_dim):
    from levanter.checkpoint import CheckpointerConfig, CheckpointInterval
    from levanter.models import Gpt2Config
    from levanter.schedule import ScheduleStep
    from levanter.tracker import JsonConfig

    stages = base.data.stages()
    if len(stages) != 2:
        raise SystemExit(f"the config needs a two-stage data.train_weights, got {len(stages)} stages")
    data = dataclasses.replace(
        base.data, train_weights=[(0, stages[0][1]), (switch, stages[1][1])], cache_dir=os.path.join(workdir, "cache")
    )
    batch = 8
    trainer_kw = dict(
        num_train_steps=steps, id=run_id, log_dir=os.path.join(workdir, "logs"), tracker=JsonConfig(),
        require_accelerator=False, steps_per_eval=max(1, steps // 5), max_eval_batches=2, train_batch_size=batch,
        checkpointer=CheckpointerConfig(base_path=os.path.join(workdir, "ckpt"), keep=[CheckpointInterval(every=steps)]),
    )
    if variant == "batch_schedule":
        trainer_kw["train_batch_size"] = [ScheduleStep(0, batch), ScheduleStep(steps // 2, 2 * batch)]
    elif variant == "grad_accum":
        import jax

        trainer_kw["train_batch_size"] = 4 * jax.device_count()
        trainer_kw["per_device_parallelism"] = 2
    model = base.model
    if model_dim:
        model = Gpt2Config(hidden_dim=model_dim, num_heads=4, num_layers=2, seq_len=64, gradient_checkpointing=False)
    return dataclasses.replace(
        base, data=data, model=model, trainer=dataclasses.replace(base.trainer, **trainer_kw), prefetch_depth=4
    )


def read_metrics(workdir, run_id):
    with open(os.path.join(workdir, "logs", run_id, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def first_diff(a: dict, b: dict, steps):
    for s in steps:
        if a.get(s) != b.get(s):
            return s
    return None


def run_variant(base, variant, *, steps, workdir, model_dim):
    from levanter.main import train_lm

    s_a, s_b = int(round(0.8 * steps)), int(round(0.9 * steps))
    for run_id, switch in (("a", s_a), ("b", s_b)):
        train_lm.main(build_config(base, run_id=run_id, workdir=workdir, steps=steps, switch=switch, variant=variant,
                                   model_dim=model_dim))
    ra, rb = read_metrics(workdir, "a"), read_metrics(workdir, "b")

    def series(rows, key):
        return {r["step"]: r[key] for r in rows if key in r and "train/loss" in r}

    names = sorted(k.split("/")[-1] for k in ra[0] if k.startswith("data/source_counts/"))
    counts_a = {r["step"]: tuple(r[f"data/source_counts/{n}"] for n in names) for r in ra if "train/loss" in r}
    counts_b = {r["step"]: tuple(r[f"data/source_counts/{n}"] for n in names) for r in rb if "train/loss" in r}
    all_steps = range(steps)
    batch_sizes = {r["step"]: sum(counts_a[r["step"]]) for r in ra if "train/loss" in r}

    def composition(weights, batch_size):
        from fractions import Fraction

        from levanter.data.mixture_layout import largest_remainder_counts

        fr = [Fraction(weights.get(n, 0)) for n in names]
        return tuple(largest_remainder_counts([f / sum(fr) for f in fr], batch_size).tolist())

    w1, w2 = (m for _, m in base.data.stages())
    stage2_a = next(
        (s for s in all_steps
         if counts_a[s] == composition(w2, batch_sizes[s]) != composition(w1, batch_sizes[s])),
        None,
    )
    return {
        "variant": variant,
        "steps": steps,
        "switch_a": s_a,
        "switch_b": s_b,
        "first_loss_diff": first_diff(series(ra, "train/loss"), series(rb, "train/loss"), all_steps),
        "first_fingerprint_diff": first_diff(series(ra, "data/fingerprint"), series(rb, "data/fingerprint"), all_steps),
        "first_counts_diff": first_diff(counts_a, counts_b, all_steps),
        "first_stage2_batch_a": stage2_a,
        "eval_steps_a": sorted(r["step"] for r in ra if "eval/loss" in r),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(REPO, "config", "gpt2_nano_curriculum.yaml"))
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 100; --quick 30)")
    p.add_argument("--variants", default="constant,batch_schedule,grad_accum")
    p.add_argument("--model-dim", type=int, default=None, help="shrink the model to this hidden size (quick: 32)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    steps = args.steps or (30 if args.quick else 100)
    model_dim = args.model_dim or (32 if args.quick else None)

    from levanter.config import parse_config
    from levanter.main.train_lm import TrainLmConfig

    base = parse_config(TrainLmConfig, args.config)
    results = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for variant in args.variants.split(","):
            t0 = time.perf_counter()
            res = run_variant(base, variant, steps=steps, workdir=os.path.join(tmp, variant), model_dim=model_dim)
            res["seconds"] = round(time.perf_counter() - t0, 1)
            results.append(res)

    print(f"\nTwo runs per variant, identical except the stage-2 start step ({args.config})")
    head = f"{'variant':>15} {'switch A':>8} {'switch B':>8} {'loss diff':>9} {'fingerprint':>11} {'counts':>6} " \
           f"{'A stage-2':>9}  verdict"
    print(head)
    print("-" * len(head))
    ok_all = True
    for r in results:
        ok = (r["first_loss_diff"] == r["first_fingerprint_diff"] == r["first_counts_diff"]
              == r["first_stage2_batch_a"] == r["switch_a"])
        ok_all &= ok
        print(f"{r['variant']:>15} {r['switch_a']:>8} {r['switch_b']:>8} {str(r['first_loss_diff']):>9} "
              f"{str(r['first_fingerprint_diff']):>11} {str(r['first_counts_diff']):>6} "
              f"{str(r['first_stage2_batch_a']):>9}  {'first difference exactly at the switch' if ok else 'MISMATCH'}")
    print("\n(first step at which the two runs' train/loss, data/fingerprint and source counts differ; "
          "'A stage-2': first step run A draws the stage-2 composition)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
