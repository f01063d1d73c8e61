"""The tokenizer a Hugging Face export carries for levanter's ``byte`` tokenizer: ``transformers`` loads it
with ``AutoTokenizer`` and gets the ids levanter trained on (each UTF-8 byte its value, EOS 256), and the
export's config.json names the EOS."""

from __future__ import annotations

import json
import logging

import jax
import pytest

transformers = pytest.importorskip("transformers")

TEXTS = ["hello world", "héllo wörld\n\ttabs and 😀 emoji", "", "  leading spaces", "a literal <|endoftext|> in text",
         "".join(chr(c) for c in range(32, 127)), "\x00\x01 control bytes"]


def test_a_byte_model_exports_a_tokenizer_with_the_same_ids(tmp_path):
    import haliax as hax

    from levanter.compat import save_hf_checkpoint
    from levanter.ingest import ByteTokenizer
    from levanter.models import Gpt2Config

    config = Gpt2Config(hidden_dim=32, num_heads=4, num_layers=1, seq_len=32, gradient_checkpointing=False)
    model = config.build(hax.Axis("vocab", 257), key=jax.random.PRNGKey(0))
    out = save_hf_checkpoint(model, config, str(tmp_path / "out"), tokenizer="byte")

    ours = ByteTokenizer()
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ids == ours.encode_batch([text])[0], text
        assert theirs.decode(ids) == text
    assert theirs.eos_token == "<|endoftext|>" and theirs.eos_token_id == ours.eos_token_id == 256
    assert theirs.decode([104, 105, 256]) == ours.decode([104, 105, 256])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == 256


def test_a_passthrough_export_says_it_has_no_tokenizer(tmp_path, caplog):
    from levanter.compat.hf_checkpoints.export import tokenizer_files

    with caplog.at_level(logging.WARNING, logger="levanter"):
        assert tokenizer_files("passthrough") == {}
    assert "passthrough" in caplog.text and "no tokenizer" in caplog.text
