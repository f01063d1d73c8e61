"""The README and the guides run as written: ``scripts/run_guides.py`` runs every ```bash block of README.md
and docs/guides/*.md, each document in a fresh clone of its own (slow), and the fast checks here keep the blocks runnable
(one spelling of the interpreter, no shell prompts, a reason on every block marked not to run)."""

import faulthandler
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import run_guides  # noqa: E402

BLOCKS = run_guides.bash_blocks(REPO)


def test_every_document_has_blocks_and_the_readme_installs_first():
    docs = {b.doc for b in BLOCKS}
    assert set(run_guides.documents(REPO)) == docs
    first = BLOCKS[0]
    assert first.doc == "README.md" and first.text.startswith(run_guides.INSTALL + " && ")


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_bash_blocks_are_runnable_as_written(block):
    for line in block.text.splitlines():
        # one spelling everywhere: the venv's interpreter, which works without activating it
        assert not re.match(r"^\s*(python3?|pip3?)\s", line) or line.startswith("python3 -m venv .venv"), line
        assert not line.startswith("$ "), f"{block.where}: a shell prompt in a bash block (use a text block)"
    if block.skip is not None:
        assert len(block.skip) > 10, f"{block.where}: say why the block cannot run"


def test_the_marker_parser(tmp_path):
    (tmp_path / "x.md").write_text(
        "text\n\n<!-- not-run: needs a TPU -->\n```bash\ngcloud x\n```\n\n```text\n$ out\n```\n"
        "- list\n  ```bash\n  echo hi\n  ```\n")
    blocks = run_guides.extract(str(tmp_path / "x.md"), "x.md")
    assert [(b.lang, b.line, b.skip, b.text) for b in blocks] == [
        ("bash", 4, "needs a TPU", "gcloud x\n"), ("text", 8, None, "$ out\n"), ("bash", 12, None, "echo hi\n")]


# Each document runs in a clone of its own after the README's install only (every guide stands alone, as a
# reader who opens one guide runs it), one test per document, so the two xdist workers share them and a failure
# names its document. The longest go first (the `first` marker; README.md's main job takes 4-6 minutes on 2
# cores, hugging-face.md about 5). The limits are longer than the suite's per-test ones (pyproject.toml), which
# are for a hung test: run_guides.py stops the document at its own limit and reports each block's time, then
# pytest-timeout and the faulthandler dump come after it.
DOC_TIMEOUT_S = 900
# In the order of their times in a CI run of 2026-12-07 (README 252 s, hugging-face 215 s, storage 100 s, trackers 84 s,
# optimizers 75 s, tokenizers 67 s, evaluation 60 s, data 38 s; the others less).
LONGEST_FIRST = ("README.md", "docs/guides/hugging-face.md", "docs/guides/storage.md", "docs/guides/trackers.md",
                 "docs/guides/optimizers.md", "docs/guides/tokenizers.md", "docs/guides/evaluation.md",
                 "docs/guides/data.md")
RUN_DOCS = sorted({b.doc for b in BLOCKS if b.skip is None},
                  key=lambda d: (LONGEST_FIRST.index(d) if d in LONGEST_FIRST else len(LONGEST_FIRST), d))


def _outputs_dir(tmp_path_factory) -> str:
    """A directory every xdist worker of this pytest run sees: each document's created files go there."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / "guide-outputs"
    path.mkdir(exist_ok=True)
    return str(path)


@pytest.mark.slow
@pytest.mark.first
@pytest.mark.timeout(DOC_TIMEOUT_S)
@pytest.mark.parametrize("doc", RUN_DOCS)
def test_each_document_runs_as_written_in_a_fresh_clone(doc, tmp_path, tmp_path_factory):
    # pytest arms one faulthandler dump per test (faulthandler_timeout); re-armed for this test's limit, so
    # that a normal run prints no stacks and a hung one prints them before pytest-timeout ends it.
    faulthandler.dump_traceback_later(DOC_TIMEOUT_S - 30, file=sys.__stderr__)
    outputs = tmp_path / "outputs.json"
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "run_guides.py"), "--venv", sys.prefix,
                        "--only", doc, "--workdir", str(tmp_path / "work"), "--outputs", str(outputs),
                        "--timeout", str(DOC_TIMEOUT_S - 120)],
                       capture_output=True, text=True, timeout=DOC_TIMEOUT_S - 60)
    print(r.stdout)  # each block's time, shown with -rP (and on a failure)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-8000:]
    assert "passed:" in r.stdout
    # Run in one checkout, no two documents may write the same file. Each document records its files, then
    # checks them against those recorded so far: of any two, the later to record sees the other.
    mine = sorted(json.loads(outputs.read_text())[doc])
    shared = _outputs_dir(tmp_path_factory)
    stem = re.sub(r"[^\w.-]", "_", doc)
    with open(os.path.join(shared, stem + ".json.tmp"), "w") as f:
        json.dump([doc, mine], f)
    os.replace(os.path.join(shared, stem + ".json.tmp"), os.path.join(shared, stem + ".json"))
    for name in sorted(n for n in os.listdir(shared) if n.endswith(".json") and n != stem + ".json"):
        with open(os.path.join(shared, name)) as f:
            other, theirs = json.load(f)
        both = sorted(p for p in set(mine) & set(theirs) if not run_guides.may_share(p))
        assert not both, f"{doc} and {other} both write {both[:10]}: give each document its own paths"


def test_a_document_past_its_time_is_stopped_and_reported(tmp_path, capsys):
    clone, work = tmp_path / "clone", tmp_path / "work"
    clone.mkdir(), work.mkdir()
    blocks = [run_guides.Block("x.md", 1, "bash", "echo started\n", None),
              run_guides.Block("x.md", 5, "bash", "sleep 60 & wait\n", None),
              run_guides.Block("x.md", 9, "bash", "echo never\n", None)]
    ok, log = run_guides.run_document("x.md", blocks, str(clone), str(work), skip_install=True, timeout=2)
    assert not ok
    out = capsys.readouterr().out
    assert "ok   x.md:1" in out and "FAIL x.md:5 (timed out, after" in out and "not reached x.md:9" in out
    assert "::: block 1 :::" in run_guides.tail_of_block(log)
