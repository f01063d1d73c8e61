"""``python -m levanter.main.train_tokenizer``: a BPE learned from the embedded corpus loads as
``data.tokenizer`` does, round-trips text, is byte-identical when trained twice, and bad inputs are one
``error:`` line (exit 2)."""

import pytest

from levanter.ingest.tokenization import load_tokenizer
from levanter.main import train_tokenizer


def test_trains_a_bpe_that_loads_as_data_tokenizer(tmp_path, capsys):
    args = ["--train_urls", '["embedded://python-docs/validation"]', "--vocab_size", "300", "--max_documents", "10"]
    train_tokenizer.cli([*args, "--output_dir", str(tmp_path / "a")])
    out = capsys.readouterr().out
    assert "trained a byte-level BPE of 300 entries on 10 documents" in out and str(tmp_path / "a") in out
    tok = load_tokenizer(str(tmp_path / "a"))
    assert tok.vocab_size == 300
    text = "def parse(self, path):\n    return json.loads(path.read_text())  # ünïcode"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text.encode())  # merges learned: fewer ids than bytes
    train_tokenizer.cli([*args, "--output_dir", str(tmp_path / "b")])
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("args, fragment", [
    (["--train_urls", '["missing.jsonl"]'], "file not found: 'missing.jsonl' (resolved to "),
    (["--train_urls", '["embedded://python-docs/validation"]', "--vocab_size", "100"], "vocab_size >= 257"),
    ([], "train_urls: give at least one input"),
])
def test_bad_inputs_are_one_error_line(tmp_path, monkeypatch, capsys, args, fragment):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        train_tokenizer.cli([*args, "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and fragment in err and "Traceback" not in err
    assert not (tmp_path / "out" / "tokenizer.json").exists()
