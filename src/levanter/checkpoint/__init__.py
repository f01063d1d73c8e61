"""Checkpoints: save a training-state pytree so that it restores bit for bit, and decide when to save.

- :mod:`~levanter.checkpoint.serialization`: the pytree <-> TensorStore format (:func:`save_checkpoint`,
  :func:`load_checkpoint`): bit-exact, checksummed, finite values only, multi-process; the save side is
  there (what it writes in :mod:`~levanter.checkpoint.leaf_writes`, how the processes agree in
  :mod:`~levanter.checkpoint.process_sync`), the load side in :mod:`~levanter.checkpoint.restore`, what
  both share (leaf names, array specs) in :mod:`~levanter.checkpoint.tree_format`.
- :mod:`~levanter.checkpoint.layout`: the layout of a run's checkpoints on local disk or an object store
  (``gs://``, ``s3://``): ``step-N`` directories, ``metadata.json``, the all-or-nothing commit (a renamed
  ``.tmp-`` directory on POSIX storage; ``metadata.json`` written last as the commit record on object
  stores), discovery of the latest complete one and of damaged ones.
- :mod:`~levanter.checkpoint.policy`: when to save and what to keep (:class:`CheckpointerConfig`,
  :class:`Checkpointer`).
- :mod:`~levanter.checkpoint.async_writer`, :mod:`~levanter.checkpoint.host_copy`: saves in the
  background -- the caller waits only for copies the next step cannot touch (on the devices where they
  have room, else in host memory).
- :mod:`~levanter.checkpoint.run_lock`: one writer per run directory (a create-if-absent lock record).
- :mod:`~levanter.checkpoint.resume`: where a run starts from -- the checkpoint it resumes (resolved and
  its metadata read once), one it branches from, whether it already finished.

Durations in the config (``save_interval: 15m``) are parsed by :func:`levanter.config.parse_timedelta`.
"""

from levanter.utils.facade import facade

__all__, __getattr__, __dir__ = facade(
    __name__,
    __package__,
    (
        "errors",
        "layout",
        "leaf_writes",
        "policy",
        "process_sync",
        "run_lock",
        "restore",
        "serialization",
        "resume",
    ),
)
