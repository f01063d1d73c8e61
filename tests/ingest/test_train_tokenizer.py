"""``python -m levanter.main.train_tokenizer``: a BPE learned from a JSON-lines file loads as
``data.tokenizer`` does and round-trips text, and bad inputs are one ``error:`` line (exit 2). That
training twice gives the same bytes is tested on ``train_bpe`` itself (test_embedded_and_tokenizers.py)."""

import pytest

from levanter.ingest.tokenization import load_tokenizer
from levanter.main import train_tokenizer


def test_trains_a_bpe_that_loads_as_data_tokenizer(tmp_path, capsys):
    import json

    lines = [json.dumps({"text": f"def parse_{i}(self, path):\n    return json.loads(path.read_text())\n"})
             for i in range(200)]
    (tmp_path / "code.jsonl").write_text("\n".join(lines) + "\n")
    train_tokenizer.cli(["--train_urls", f'["{tmp_path}/code.jsonl"]', "--vocab_size", "300",
                         "--max_documents", "150", "--output_dir", str(tmp_path / "a")])
    out = capsys.readouterr().out
    assert "trained a byte-level BPE of 300 entries on 150 documents" in out and str(tmp_path / "a") in out
    tok = load_tokenizer(str(tmp_path / "a"))
    assert tok.vocab_size == 300
    text = "def parse(self, path):\n    return json.loads(path.read_text())  # ünïcode"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text.encode()) // 2  # merges learned: far fewer ids


@pytest.mark.parametrize("args, fragment", [
    (["--train_urls", '["missing.jsonl"]'], "file not found: 'missing.jsonl' (resolved to "),
    (["--train_urls", '["embedded://python-docs/validation"]', "--vocab_size", "100"], "vocab_size >= 257"),
    ([], "train_urls: give at least one input"),
    (["--train_urls", '["embedded://python-doc/train"]'], "python-doc"),
])
def test_bad_inputs_are_one_error_line(tmp_path, monkeypatch, capsys, args, fragment):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        train_tokenizer.cli([*args, "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and fragment in err and "Traceback" not in err
    assert not (tmp_path / "out" / "tokenizer.json").exists()
