"""Supervised fine-tuning on chat data: ``python -m levanter.main.sft --config_path config/sft.yaml``.

The config is upstream Levanter's fine-tuning YAML (:class:`levanter.sft_config.SFTConfig`: ``supervised_data``,
``chat_train_urls``, ``messages_field``, ``mixture_weights``, ``max_seq_len``, ``tokenizer``,
``initialize_from_hf``, ``model_name_or_path``, ``hf_save_path``, ...). It is mapped onto the
:class:`~levanter.lm_config.TrainLmConfig` of the same run (:func:`levanter.sft_config.to_train_lm_config`)
and trained by :func:`levanter.run.main`, exactly as ``train_lm`` trains: the same validation before any
work, caches, resumption (rerun with the same ``trainer.id``), checkpoints, metrics and exit statuses. The
data is chat-formatted: each conversation is rendered by the chat template and only its assistant tokens are
trained on (:mod:`levanter.ingest.chat`).

Keys it does not build are refused by name with exit status 2 (see :mod:`levanter.sft_config`), as are all
user errors (one ``error:`` paragraph, no traceback; ``docs/reference/errors.md``). ``main(config)`` takes an
``SFTConfig`` and returns what ``run.main`` does.
"""

from __future__ import annotations

__all__ = ["main", "cli_main", "cli"]

if __name__ == "__main__":
    # Before the heavy imports, so that re-executing costs only an interpreter start-up.
    from levanter.utils.malloc import reexec_with_hugepage_malloc

    reexec_with_hugepage_malloc()
import logging

import levanter.config
from levanter import run
from levanter.sft_config import SFTConfig, fresh_model_fn, to_train_lm_config

logger = logging.getLogger(__name__)


def main(config: SFTConfig) -> dict:
    """Fine-tune; returns ``{"run_id", "final_step", "final_loss"}``."""
    train_config = to_train_lm_config(config)
    fresh = fresh_model_fn(config, train_config.data.the_tokenizer()) if config.reinit_tokens else None
    return run.main(train_config, fresh_model=fresh)


@levanter.config.main
def cli_main(config: SFTConfig):
    return main(config)


def cli(argv=None) -> None:
    """The command-line entry point: exit statuses as ``train_lm``'s (:func:`levanter.run.cli_errors`)."""
    run.run_config_command(__name__, cli_main, argv)


if __name__ == "__main__":
    run.start_command(cli)
