"""Reading config files and command-line overrides (``levanter.config``): ``!include``, duplicate keys,
where an error is blamed (the file or the override), union sections, and configs at fsspec URLs.

The bad-input catalogue (``tests/main/test_bad_inputs.py``) runs the user-facing cases through the real
entry points; these tests pin the parsing rules behind them.
"""

from __future__ import annotations

import glob
from pathlib import Path

import fsspec
import pytest

from levanter.config import ConfigError, load_yaml, parse_config, split_config_path
from levanter.main import train_lm
from levanter.main.cache_dataset import load_data_config

REPO = Path(__file__).resolve().parents[2]

DATA = """\
train_urls: ["embedded://python-docs/validation"]
tokenizer: byte
cache_dir: cache
"""
REST = """\
model: {type: gpt2, hidden_dim: 32, num_heads: 4, num_layers: 1, seq_len: 32}
trainer: {num_train_steps: 4, train_batch_size: 8}
optimizer: {learning_rate: 0.01}
"""


def write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_include_splices_a_file_relative_to_the_including_one(tmp_path, monkeypatch):
    write(tmp_path / "data" / "docs.yaml", DATA)
    cfg_path = write(tmp_path / "run.yaml", "data: !include data/docs.yaml\n" + REST)
    monkeypatch.chdir("/")  # relative to the including file, not to the working directory
    cfg = parse_config(train_lm.TrainLmConfig, cfg_path)
    assert cfg.data.train_urls == ["embedded://python-docs/validation"]
    assert cfg.data.cache_dir == "cache"
    assert load_data_config(cfg_path).tokenizer == "byte"  # cache_dataset reads it the same way


def test_include_as_merge_source_and_overridden_keys(tmp_path):
    write(tmp_path / "base.yaml", DATA + "shuffle: true\n")
    cfg_path = write(tmp_path / "run.yaml", "data:\n  <<: !include base.yaml\n  shuffle: false\n" + REST)
    cfg = parse_config(train_lm.TrainLmConfig, cfg_path)
    assert cfg.data.shuffle is False  # a key given next to a merge replaces the merged one: not a duplicate
    assert cfg.data.tokenizer == "byte"


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    text = "base: &b {a: 1, b: 2}\nrun:\n  <<: *b\n  a: 3\n"
    assert load_yaml(write(tmp_path / "x.yaml", text))["run"] == {"a": 3, "b": 2}


def test_include_loop_is_refused(tmp_path):
    write(tmp_path / "a.yaml", "x: !include b.yaml\n")
    write(tmp_path / "b.yaml", "y: !include a.yaml\n")
    with pytest.raises(ConfigError, match=r"loops \(or nests too deep\): .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_yaml(str(tmp_path / "a.yaml"))


def test_included_file_errors_name_that_file(tmp_path):
    inc = write(tmp_path / "data.yaml", DATA + "tokenizer: gpt2\n")
    cfg_path = write(tmp_path / "run.yaml", "data: !include data.yaml\n" + REST)
    with pytest.raises(ConfigError) as e:
        parse_config(train_lm.TrainLmConfig, cfg_path)
    assert f"{inc}: duplicate key `tokenizer` on lines 2 and 4" in str(e.value)
    write(tmp_path / "data.yaml", "train_urls: [x\n")
    with pytest.raises(ConfigError, match=f"{inc}, line 2"):
        parse_config(train_lm.TrainLmConfig, cfg_path)
    cfg_path = write(tmp_path / "run.yaml", "data: !include nope.yaml\n" + REST)
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        parse_config(train_lm.TrainLmConfig, cfg_path)


def test_errors_in_included_files_name_the_file_and_line_that_wrote_the_key(tmp_path):
    """An unknown key, a bad value and a check across keys, each written by an included file (spliced in
    as a value, or merged with ``<<:``), name that file and the key's line, not the including one."""
    run = str(tmp_path / "run.yaml")
    data = "data:\n" + "".join(f"  {line}\n" for line in DATA.splitlines())
    model = write(tmp_path / "parts" / "model.yaml", "type: gpt2\nhidden_dim: 32\nnum_heads: 4\nseq_len: 32\n")
    trainer = write(tmp_path / "parts" / "trainer.yaml", "trainer:\n  num_train_steps: 4\n  train_batch_sise: 8\n")
    write(tmp_path / "run.yaml", data + "model: !include parts/model.yaml\n<<: !include parts/trainer.yaml\n")
    with pytest.raises(ConfigError) as e:
        parse_config(train_lm.TrainLmConfig, run)
    assert str(e.value).startswith(f"{trainer}, line 3 (included from {run}): `trainer`: unknown key `train_batch_sise`")
    write(tmp_path / "parts" / "trainer.yaml", "trainer:\n  num_train_steps: 4\n")
    write(tmp_path / "parts" / "model.yaml", "type: gpt2\nhidden_dim: 32\nnum_heads: 4\nseq_len: 3O\n")
    with pytest.raises(ConfigError) as e:
        parse_config(train_lm.TrainLmConfig, run)
    assert str(e.value).startswith(f"{model}, line 4 (included from {run}): `model.seq_len`: "), str(e.value)
    write(tmp_path / "parts" / "model.yaml", "type: gpt2\nhidden_dim: 30\nnum_heads: 4\n")
    with pytest.raises(ConfigError) as e:
        parse_config(train_lm.TrainLmConfig, run)
    assert str(e.value).startswith(f"{model}, line 2 (included from {run}): model.hidden_dim (30) must be"), str(e.value)
    write(tmp_path / "parts" / "model.yaml", "type: gpt2\nhidden_dim: 32\nnum_heads: 4\n")
    with pytest.raises(ConfigError) as e:  # a key of the including file is still blamed on it
        parse_config(train_lm.TrainLmConfig, write(tmp_path / "run.yaml", data.replace("tokenizer", "tokeniser")
                                                    + "model: !include parts/model.yaml\n"))
    assert str(e.value).startswith(f"{run}: `data`: unknown key `tokeniser`"), str(e.value)


def test_a_value_starting_with_a_dash_is_the_value_of_the_key_before_it():
    from levanter.cli_args import join_dash_values

    assert join_dash_values(["--a.b", "-5s", "--c", "-1", "--d", "x"]) == ["--a.b=-5s", "--c=-1", "--d", "x"]
    assert join_dash_values(["--a", "--b", "1", "--c=-2", "-h"]) == ["--a", "--b", "1", "--c=-2", "-h"]
    assert join_dash_values(["--a", "-h"]) == ["--a", "-h"]


@pytest.mark.parametrize(
    "given, expected",
    [
        ("save_interval", "trainer.checkpointer.save_interval"),  # a section left out
        ("cache_options.backend", "data.cache_options.backend"),  # a section left out, keeping the rest
        ("trainer.num_train_step", "trainer.num_train_steps"),  # a close spelling
        ("num_train_step", "trainer.num_train_steps"),  # both
        ("no_such_flag", None),
    ],
)
def test_suggest_key(given, expected):
    from levanter.cli_args import suggest_key

    known = ["trainer.checkpointer.save_interval", "trainer.progress_interval", "trainer.num_train_steps",
             "data.cache_options.backend", "data.cache_dir", "data.configs.<name>.cache_dir"]
    assert suggest_key(given, known) == expected


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("a: 1\nb: {c: 1, d: 2, c: 3}\n", "duplicate key `b.c` on lines 2 and 2"),
        ("a:\n  - {x: 1}\n  - {x: 1, x: 2}\n", "duplicate key `a.1.x` on lines 3 and 3"),
        ("a: 1\n'a': 2\n", "duplicate key `a` on lines 1 and 2"),
    ],
)
def test_duplicate_keys_at_any_depth(tmp_path, text, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_yaml(write(tmp_path / "x.yaml", text))


def test_same_key_in_different_mappings_is_fine(tmp_path):
    text = "a: {lr: 1}\nb: {lr: 2}\nc: [{lr: 3}, {lr: 4}]\n"
    assert load_yaml(write(tmp_path / "x.yaml", text))["c"] == [{"lr": 3}, {"lr": 4}]


def parse_text(tmp_path: Path, text: str, args=()):
    return parse_config(train_lm.TrainLmConfig, write(tmp_path / "run.yaml", text), args)


def test_a_bad_override_is_blamed_on_the_command_line_not_the_file(tmp_path):
    good = "data:\n" + "".join(f"  {line}\n" for line in DATA.splitlines()) + REST
    cfg_path = str(tmp_path / "run.yaml")
    with pytest.raises(ConfigError) as e:
        parse_text(tmp_path, good, ["--trainer.num_train_steps", "ten"])
    assert str(e.value).startswith("command line: --trainer.num_train_steps ten: ")
    assert cfg_path not in str(e.value)
    with pytest.raises(ConfigError) as e:  # the same bad value in the file is blamed on the file
        parse_text(tmp_path, good.replace("num_train_steps: 4", "num_train_steps: ten"))
    assert str(e.value).startswith(f"{cfg_path}: `trainer.num_train_steps`")
    with pytest.raises(ConfigError) as e:  # an override inside the data union, in the `--key=value` form
        parse_text(tmp_path, good, ["--data.shuffle=maybe"])
    assert str(e.value).startswith("command line: --data.shuffle maybe: ")
    with pytest.raises(ConfigError) as e:  # a check across keys names the overrides it mentions
        args = ["--model.seq_len", "2048", "--model.n_positions", "1024", "--trainer.id", "a"]
        parse_text(tmp_path, good, args)
    blamed = "command line: --model.seq_len 2048 --model.n_positions 1024: model.seq_len (2048) exceeds"
    assert str(e.value).startswith(blamed)


def test_config_at_a_url_is_named_by_its_url(tmp_path):
    fs = fsspec.filesystem("memory")
    fs.pipe("/cfg/data.yaml", DATA.encode())
    fs.pipe("/cfg/run.yaml", ("data: !include data.yaml\n" + REST).encode())
    cfg = parse_config(train_lm.TrainLmConfig, "memory://cfg/run.yaml")
    assert cfg.data.tokenizer == "byte"  # the include resolved against the URL
    fs.pipe("/cfg/run.yaml", ("data: !include data.yaml\n" + REST + "trainr: {}\n").encode())
    with pytest.raises(ConfigError) as e:
        parse_config(train_lm.TrainLmConfig, "memory://cfg/run.yaml")
    assert str(e.value).startswith("memory://cfg/run.yaml: unknown top-level key `trainr`")


def test_data_section_union_picks_the_member_meant(tmp_path):
    # Keys of one source: reported against a single source; a mixture's keys: against the mixture.
    with pytest.raises(ConfigError, match=r"`data`: unknown key `shufle` \(did you mean `shuffle`\?\)"):
        parse_text(tmp_path, "data: {train_urls: [x], shufle: 1}\n")
    with pytest.raises(ConfigError, match=r"`data.shuffle`: expected bool or int, got 'maybe'"):
        parse_text(tmp_path, "data: {train_urls: [x], shuffle: maybe}\n")
    mix = "data: {configs: {a: {train_urls: [x]}}, train_weights: {a: 1}, mixture_blok_size: 4}\n"
    with pytest.raises(ConfigError, match=r"`mixture_blok_size` \(did you mean `mixture_block_size`"):
        parse_text(tmp_path, mix)


def test_registry_sections(tmp_path):
    with pytest.raises(ConfigError, match=r"`model`: no `type:` given; .* \(did you mean `type` for `typ`"):
        parse_text(tmp_path, "model: {typ: gpt2, hidden_dim: 32}\n")
    with pytest.raises(ConfigError, match=r"`model`: expected a mapping with `type:` \(one of [^)]*gpt2, llama[^)]*qwen3\)"):
        parse_text(tmp_path, "model: gpt2\n")
    with pytest.raises(ConfigError, match=r"`model`: unknown key `hiden_dim` \(did you mean `hidden_dim`"):
        parse_text(tmp_path, "model: {type: llama, hiden_dim: 32}\n")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config_path"], "--config_path needs a file"),
        (["--config_path="], "--config_path needs a file"),
        (["--config_path", "--trainer.id", "x"], "--config_path needs a file (got --trainer.id after it)"),
        (["--config_path", "a.yaml", "--config_path=b.yaml"], "--config_path given twice (a.yaml and b.yaml)"),
    ],
)
def test_config_path_without_a_file(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        split_config_path(argv)


def test_split_config_path_keeps_the_rest():
    argv = ["--a", "1", "--config_path=x.yaml", "--b", "2"]
    assert split_config_path(argv) == ("x.yaml", ["--a", "1", "--b", "2"])
    assert split_config_path(["--a", "1"]) == (None, ["--a", "1"])


@pytest.mark.parametrize("path", sorted(glob.glob(str(REPO / "config" / "data" / "*.yaml"))))
def test_shipped_data_configs_load(path):
    assert load_data_config(path) is not None
