"""Memory before a run: the train step compiled ahead of time on abstract inputs (nothing allocated, no data
read), measured, and weighed against a device's memory.

One core, :mod:`~levanter.memory.step` (:class:`StepCompiler`: the trainer's own step, shardings and mesh,
compiled for ``jax.ShapeDtypeStruct`` inputs; :class:`StepMemory`: what XLA's ``memory_analysis()``, or a
compiler's out-of-memory refusal, says one device needs), serves every user:

- :mod:`~levanter.memory.fit`: the run's check before the first step (:func:`fit_trainer`), whose compiled
  step the run then trains with, and ``trainer.per_device_parallelism: auto``;
- :mod:`~levanter.memory.levers`: the microbatch search and the keys that lower a step that does not fit,
  each figure from a compile;
- :mod:`~levanter.memory.plan`: ``train_lm --dry_run``, the per-device plan and its table; its flags in
  :mod:`~levanter.memory.flags`;
- :mod:`~levanter.memory.shapes`: the cheapest look, a lower bound from shapes alone (:func:`check_memory`),
  before anything is compiled;
- :mod:`~levanter.memory.slice_plan`: ``train_lm --dry_run --slice NAME``, the step compiled by the TPU
  compiler for a slice this machine does not have (its devices and mesh in
  :mod:`~levanter.memory.tpu_compile`, the slice table in :mod:`~levanter.memory.tpu_slices`, the
  collectives read from the compiled HLO in :mod:`~levanter.memory.hlo`);
- :mod:`~levanter.memory.tpu_reserve`: what the TPU runtime reserves for a step's temporaries (the HBM a
  chip's ``peak_bytes_reserved`` reports), read from the TPU compiler's buffer assignment or its record
  beside the compilation cache: what every check weighs on a TPU, in place of the compiler's larger
  figure.

Lazy: importing the package imports none of its modules (the entry point's ``--slice`` must choose JAX's
platform before anything starts a backend).
"""

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(
    __name__,
    __package__,
    ("step", "levers", "fit", "shapes", "flags", "plan", "tpu_slices", "tpu_compile", "hlo", "slice_plan",
     "tpu_reserve"),
    lazy=True,
)
