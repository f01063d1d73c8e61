"""Check which of upstream Levanter's top-level configs load here as ``train_lm`` (or ``sft``, ``lora_lm``) configs.

    python scripts/check_upstream_configs.py DIR [--verbose]

DIR is upstream's ``config/`` directory (a checkout of stanford-crfm/levanter; nothing of it is copied into
this repository). Every ``*.yaml`` directly under DIR is read the way ``python -m levanter.main.train_lm
--config_path X`` reads it (``levanter.config.parse_config`` into ``TrainLmConfig``, ``!include`` files
resolved relative to the including file, so DIR's subdirectories must be there), then put through the checks
that need neither data, network nor devices: the upstream keys refused when set
(``levanter.refused_keys.check_refused``), ``trainer.quantization`` on this machine's JAX platform, the
learning-rate schedule for ``trainer.num_train_steps``, and the ``eval_harness`` section
(``levanter.lm_config.check_eval_harness``: its tasks are named, not loaded). Nothing is trained, tokenized or downloaded.

A file whose top-level keys include one only fine-tuning configs have (``supervised_data``,
``chat_train_urls``, ``mixture_weights``, ... : ``levanter.sft_config.SFT_KEYS``) is read as ``python -m
levanter.main.sft`` reads it instead: into ``SFTConfig``, mapped onto the ``TrainLmConfig`` it runs
(``levanter.sft_config.to_train_lm_config``, whose refusals name the SFT key), then the same checks. One with
a top-level key only LoRA configs have (``lora``, ``peft_save_path``, ``merged_hf_save_path``, ...:
``LORA_KEYS``) is read as ``python -m levanter.main.lora_lm`` reads it: into ``LoraLmConfig``, mapped onto the
``TrainLmConfig`` it runs (``levanter.main.lora_lm.to_train_lm_config``, which reads no checkpoint), then the same
checks.

One line per file, then the counts:

* ``parses`` -- the config loads and passes those checks;
* ``refused`` -- refused naming the feature (``key=value is not supported: ...``, an optimizer type or a
  config of another upstream entry point);
* ``needs family`` -- ``model.type`` is a model family not built here (the family is named);
* ``error`` -- anything else (a key or value this code does not read): the message is printed.

Exit status 0 after a complete report (whatever the counts), 2 when DIR has no YAML files.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import jax  # noqa: E402

from levanter.config import parse_config  # noqa: E402
from levanter.refused_keys import check_refused  # noqa: E402
from levanter.lm_config import TrainLmConfig, check_eval_harness  # noqa: E402
from levanter.sft_config import SFT_KEYS, SFTConfig, to_train_lm_config  # noqa: E402
from levanter.main import lora_lm  # noqa: E402

PARSES, REFUSED, FAMILY, ERROR = "parses", "refused", "needs family", "error"
# Top-level keys only LoRA configs have: a config carrying one is checked as a LoraLmConfig.
LORA_KEYS = ("lora", "peft_save_path", "peft_hf_upload", "merged_hf_save_path", "merged_hf_upload",
             "max_train_length")
_FAMILY = re.compile(r"`model`: unknown type '([\w.-]+)'")
_REFUSED_KEY = re.compile(r"([\w.]+=[^\s{\[(]+(?= is not supported)|[\w.]+(?==.*? is not supported))")
_OTHER_ENTRY = re.compile(r"a config of (upstream's [^,(]+)")


def check(path: Path) -> tuple[str, str]:
    """``(outcome, detail)`` for one config file: see the module docstring."""
    try:
        keys = top_level_keys(path)
        if any(k in keys for k in SFT_KEYS):
            config = to_train_lm_config(parse_config(SFTConfig, str(path)))
        elif any(k in keys for k in LORA_KEYS):
            config = lora_lm.to_train_lm_config(parse_config(lora_lm.LoraLmConfig, str(path)))
        else:
            config = parse_config(TrainLmConfig, str(path))
        check_refused(config)
        if config.trainer.quantization is not None:
            config.trainer.quantization.check(jax.default_backend())
        config.optimizer.lr_scheduler(config.trainer.num_train_steps)
        check_eval_harness(config)
    except (ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        return classify(str(e))
    return PARSES, ""


def top_level_keys(path: Path) -> set:
    """The file's top-level keys (none when it cannot be read: ``parse_config`` reports that)."""
    import yaml

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_constructor("!include", lambda loader, node: None)  # only the top-level keys matter here
    try:
        raw = yaml.load(path.read_text(), Loader=_Loader)
    except (OSError, yaml.YAMLError):
        return set()  # parse_config reports it
    return set(raw) if isinstance(raw, dict) else set()


def classify(message: str) -> tuple[str, str]:
    """The outcome a failure message stands for, and the feature it names (or the message itself)."""
    message = " ".join(message.split())
    m = _FAMILY.search(message)
    if m is not None:
        return FAMILY, m.group(1)
    if "is not supported" in message:
        other = _OTHER_ENTRY.search(message)
        if other is not None:
            return REFUSED, other.group(1).strip()
        key = _REFUSED_KEY.search(message)
        why = message.split("is not supported", 1)[1].lstrip(": ")
        return REFUSED, f"{key.group(1) if key else '?'}: {why}"
    return ERROR, message


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="upstream Levanter's config/ directory")
    parser.add_argument("--verbose", action="store_true", help="print each refusal's full reason")
    args = parser.parse_args(argv)
    files = sorted(p for p in Path(args.dir).glob("*.yaml") if p.is_file())
    if not files:
        print(f"error: no *.yaml files directly under {args.dir}: give upstream Levanter's config/ directory",
              file=sys.stderr)
        return 2
    counts = {k: 0 for k in (PARSES, REFUSED, FAMILY, ERROR)}
    width = max(len(p.name) for p in files)
    for path in files:
        outcome, detail = check(path)
        counts[outcome] += 1
        if not args.verbose and outcome == REFUSED and len(detail) > 110:
            detail = detail[:107] + "..."
        print(f"{outcome:<13} {path.name:<{width}}  {detail}".rstrip())
    print(os.linesep + ", ".join(f"{k}: {v}" for k, v in counts.items()) + f" (of {len(files)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
