#!/usr/bin/env python
"""Helper for ``scripts/bench/train.py --upstream-venv``: run with the *upstream* venv's Python.

``prepare OUT`` writes, offline, what upstream Levanter 1.2.dev1644 needs to train a gpt2 model on the
same byte-level tokens as our ``tokenizer: byte``:

* ``OUT/tokenizer/``: a Hugging Face tokenizer directory (``PreTrainedTokenizerFast``) that encodes text
  as its UTF-8 bytes, id = byte value (0..255), with ``<|endoftext|>`` = 256 as EOS, i.e. the same ids and
  the same 257-entry vocabulary as our ``ByteTokenizer``. It is a byte-level BPE with the 256 single-byte
  symbols and no merges (GPT-2's byte-to-unicode alphabet, no regex split).
* ``OUT/hf_home/``: a fake Hugging Face hub cache holding ``gpt2`` (a default ``GPT2Config`` plus the
  tokenizer above, no weights). Upstream's gpt2 config hard-codes ``reference_checkpoint="gpt2"`` and
  loads its config and tokenizer from the hub even when training from scratch; with
  ``HF_HOME=OUT/hf_home HF_HUB_OFFLINE=1`` it finds them here instead.

Usage (train.py calls it; by hand only for debugging)::

    UPSTREAM_VENV/bin/python scripts/bench/upstream_train.py prepare /tmp/upstream-prep
"""

from __future__ import annotations

import argparse
import json
import os

EOS = "<|endoftext|>"
FAKE_COMMIT = "0" * 40


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (what ``ByteLevel`` pre-tokenizes to)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab[EOS] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS)
    fast.model_max_length = 1 << 30
    return fast


def check_tokenizer(fast) -> None:
    text = "def f(x):\n    return 'é' + x  # ünïcode ✓\n"
    ids = fast(text, add_special_tokens=False)["input_ids"]
    expected = list(text.encode("utf-8"))
    if ids != expected:
        raise SystemExit(f"byte tokenizer mismatch: {ids[:20]} vs {expected[:20]}")
    if len(fast) != 257 or fast.eos_token_id != 256:
        raise SystemExit(f"byte tokenizer: want 257 tokens, EOS 256; got {len(fast)}, {fast.eos_token_id}")


def prepare(out: str) -> dict:
    from transformers import GPT2Config

    fast = byte_tokenizer()
    check_tokenizer(fast)
    tok_dir = os.path.join(out, "tokenizer")
    fast.save_pretrained(tok_dir)

    snap = os.path.join(out, "hf_home", "hub", "models--gpt2", "snapshots", FAKE_COMMIT)
    os.makedirs(snap, exist_ok=True)
    refs = os.path.join(out, "hf_home", "hub", "models--gpt2", "refs")
    os.makedirs(refs, exist_ok=True)
    with open(os.path.join(refs, "main"), "w") as f:
        f.write(FAKE_COMMIT)
    GPT2Config(vocab_size=257, bos_token_id=256, eos_token_id=256).save_pretrained(snap)
    fast.save_pretrained(snap)
    return {"tokenizer": tok_dir, "hf_home": os.path.join(out, "hf_home")}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("prepare", help="write OUT/tokenizer and OUT/hf_home")
    sp.add_argument("out")
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        print(json.dumps(prepare(args.out)))


if __name__ == "__main__":
    main()
