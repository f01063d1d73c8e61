"""Utilities every part may import: storage (:mod:`.fs`, the one door over :mod:`.paths`, :mod:`.files`,
:mod:`.ts_spec` and :mod:`.storage_errors`), the Hugging Face hub's environment (:mod:`.hub`), fault
injection, huge pages, process liveness, whether a stream can show a progress bar (:mod:`.terminal`), accelerator
FLOP/s, linear layers by dotted path (:mod:`.layer_select`), JAX's persistent compilation cache
(:mod:`.compile_cache`), the devices a traced program is partitioned over (:mod:`.mesh`), and the facades of
the packages.

Names are loaded on first use: every part imports this package, most only for :mod:`.fs`, and tokenizer
pool workers must not pay for what they do not call. Callers mostly import the modules (``from
levanter.utils import fs``); the names are re-exported here too, as in every package.
"""

from .facade import facade

__all__, __getattr__, __dir__ = facade(
    __name__,
    __package__,
    (
        "paths",
        "storage_errors",
        "ts_spec",
        "fs_clients",
        "files",
        "atomic_writes",
        "access_checks",
        "hub",
        "fault",
        "flops",
        "malloc",
        "process",
        "terminal",
        "layer_select",
        "compile_cache",
        "mesh",
        "facade",
    ),
    lazy=True,
)
