"""Run every ```bash block of README.md and of docs/guides/*.md, as written and in order, in one fresh clone.

    .venv/bin/python scripts/run_guides.py                 # all documents, reusing ./.venv (see --venv)
    .venv/bin/python scripts/run_guides.py --only data.md  # one document (its blocks still in order)
    .venv/bin/python scripts/run_guides.py --list          # the blocks, and the ones marked not to run

What it checks, for the documents in the order README.md, then docs/guides/*.md by name:

* every ```bash block exits with status 0 (each document's blocks run in one bash process, in order, so a
  variable or ``export`` of one block reaches the next block of the same document, never another document);
* no document changes or deletes a file that an earlier document wrote (each guide owns its paths);
  ``--outputs`` writes the files each document created, so that documents run in clones of their own (as
  ``tests/project/test_guides.py`` runs them, each after the README's install only) are checked against each other;
* no tracked file is changed, and every output is git-ignored (``git status --porcelain`` stays empty).

A block that cannot run offline or in CI (a TPU launch, a cloud bucket, a real wandb login) is marked in
the markdown by a comment on the line before its fence, with the reason, which is printed when skipped::

    <!-- not-run: needs gcloud and a TPU quota -->
    ```bash

The clone: ``git clone`` of this checkout into a temporary directory, plus the checkout's uncommitted
changes (modified and untracked, not ignored, files), so the working tree as it stands is what runs.

The virtual environment: by default (``--venv``, default ``.venv`` of this checkout) the clone's ``.venv``
is a symlink to an existing environment, and the README's install command (exactly ``INSTALL`` below,
which starts the main job's and the tests' command lines) is replaced by ``true``: the rest of the line
runs as written. ``PYTHONPATH`` is the clone's ``src``, so the clone's code runs whatever checkout the
environment's editable install points at. ``--venv none`` runs the install command too (a real fresh
install: minutes, and the package index must be reachable).

The environment of the blocks: ``HOME`` is an empty directory of the run (nothing reaches the user's home),
``XLA_FLAGS``, ``JAX_PLATFORMS`` and ``PYTHONPATH`` are cleared as on a user's shell, ``HF_HUB_OFFLINE=1``;
JAX's persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``, kept if set, else a directory of the
run) lets the many small training commands share compiled programs, and ``LEVANTER_EMBEDDED_DIR`` (kept if
set, else a directory of the run) their embedded corpus's text, parsed from the stdlib once instead of once
per cache directory (``levanter.ingest.embedded``): caches, not outputs; every command still writes its own
data caches in the clone.

Exit status 0 when every block ran, 1 when one failed (its output's tail is printed), 2 for bad arguments.
``tests/project/test_guides.py`` runs this (slow) and checks the markdown's blocks without running them (fast).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL = "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]'"
NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)\s*$")
DOC_TIMEOUT_S = 1200


@dataclasses.dataclass
class Block:
    doc: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    skip: Optional[str]  # the not-run reason, or None

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def documents(root: str = REPO) -> List[str]:
    """README.md, then the guides by name (paths relative to ``root``)."""
    guides = sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "docs", "guides", "*.md")))
    return ["README.md", *guides]


def extract(path: str, rel: str) -> List[Block]:
    """The fenced blocks of a markdown file, in order, with the not-run marker of each."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks: List[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3)
        close = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        start, body = i, []
        i += 1
        while i < len(lines) and not close.match(lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        marker = NOT_RUN.match(lines[prev]) if prev >= 0 else None
        blocks.append(Block(rel, start + 1, lang, "\n".join(body) + "\n", marker.group(1) if marker else None))
    return blocks


def bash_blocks(root: str = REPO, only: Optional[List[str]] = None) -> List[Block]:
    out = []
    for rel in documents(root):
        if only and not any(rel == o or os.path.basename(rel) == o for o in only):
            continue
        out.extend(b for b in extract(os.path.join(root, rel), rel) if b.lang in ("bash", "sh", "shell"))
    return out


# ------------------------------------------------------------------------------------------- the clone
# The debug logs of the commands that have no run of their own (progress.open_command_debug_log): every
# invocation appends to them by design, so two guides running the same command share them.
SHARED_LOGS = frozenset({"logs/export_lm_to_hf/debug.log", "logs/cache_dataset/debug.log"})
# The shipped configs' data caches (``cache/...``): the first run of a config in a checkout builds its cache and
# every later run reads it unchanged (which the in-order run checks), so documents run in clones of their own
# may each create them.
SHARED_PREFIXES = ("cache/",)


def may_share(path: str) -> bool:
    """Whether two documents run in clones of their own may both create ``path``."""
    return path in SHARED_LOGS or path.startswith(SHARED_PREFIXES)


def make_clone(repo: str, dest: str) -> None:
    """``git clone`` of ``repo`` into ``dest``, then the working tree's uncommitted state laid over it."""
    subprocess.run(["git", "clone", "-q", repo, dest], check=True)
    changed = _git_lines(repo, "ls-files", "-m", "-o", "--exclude-standard")
    for rel in changed:
        src = os.path.join(repo, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))
    for rel in _git_lines(repo, "ls-files", "-d"):
        if os.path.exists(os.path.join(dest, rel)):
            os.remove(os.path.join(dest, rel))


def _git_lines(cwd: str, *args: str) -> List[str]:
    r = subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True)
    return [line for line in r.stdout.splitlines() if line]


def snapshot(root: str) -> Dict[str, Tuple[int, int]]:
    """Every file under ``root`` (not ``.git``, not ``.venv``) -> (size, mtime in ns)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if dirpath == root:
            dirnames[:] = [d for d in dirnames if d not in (".git", ".venv")]
        for name in filenames:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out


# ------------------------------------------------------------------------------------------- running
def script_for(blocks: List[Block], status_path: str, skip_install: bool) -> str:
    """One bash script for a document's blocks: each preceded by a marker (stdout and the status file)
    and followed by a check of its last command's status (``set -e`` does not stop on a failure inside
    an ``a && b`` list)."""
    parts = [
        "set -e",
        f"__begin() {{ echo \"::: block $1 :::\"; echo \"begin $1 $(date +%s.%N)\" >> {_q(status_path)}; }}",
        f"__end() {{ local rc=$2; echo \"end $1 $rc $(date +%s.%N)\" >> {_q(status_path)}; "
        "if [ \"$rc\" -ne 0 ]; then exit \"$rc\"; fi; }",
    ]
    for k, b in enumerate(blocks):
        if b.skip is not None:
            continue
        text = b.text
        if skip_install and INSTALL in text:
            text = text.replace(INSTALL, "true")
        parts += [f"__begin {k}", text.rstrip("\n"), f"__end {k} $?"]
    return "\n".join(parts) + "\n"


def _q(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def block_env(clone: str, work: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "XLA_FLAGS", "JAX_PLATFORMS", "VIRTUAL_ENV", "PYTEST_CURRENT_TEST")
           and not k.startswith("PYTEST_XDIST")}
    home = os.path.join(work, "home")
    os.makedirs(home, exist_ok=True)
    env.update(HOME=home, PYTHONPATH=os.path.join(clone, "src"), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(work, "xla-cache"))
    env.setdefault("LEVANTER_EMBEDDED_DIR", os.path.join(work, "embedded"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    return env


def run_document(doc: str, blocks: List[Block], clone: str, work: str, *, skip_install: bool,
                 timeout: float) -> Tuple[bool, str]:
    """Run one document's blocks; prints a line per block; returns (ok, the log's path)."""
    stem = re.sub(r"[^\w.-]", "_", doc)
    status = os.path.join(work, f"{stem}.status")
    log = os.path.join(work, f"{stem}.log")
    script = os.path.join(work, f"{stem}.sh")
    with open(script, "w") as f:
        f.write(script_for(blocks, status, skip_install))
    open(status, "w").close()
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", script], cwd=clone, env=block_env(clone, work), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            # what the blocks left running (a local object-store server started with `&`) ends with them
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            proc.wait()
    events = {}
    with open(status) as f:
        for line in f:
            kind, k, *rest = line.split()
            events.setdefault(int(k), {})[kind] = rest
    ok = rc == 0
    for k, b in enumerate(blocks):
        if b.skip is not None:
            print(f"  skip {b.where}: {b.skip}")
            continue
        ev = events.get(k, {})
        if "begin" not in ev:
            print(f"  not reached {b.where}")
            continue
        t0 = float(ev["begin"][0])
        if "end" in ev:
            brc, t1 = int(ev["end"][0]), float(ev["end"][1])
            print(f"  {'ok  ' if brc == 0 else 'FAIL'} {b.where} ({t1 - t0:.1f} s)" + ("" if brc == 0 else f", exit status {brc}"))
        else:
            why = "timed out" if rc is None else f"exit status {rc}"
            print(f"  FAIL {b.where} ({why}, after {time.time() - t0:.0f} s)")
    return ok, log


def tail_of_block(log: str, chars: int = 6000) -> str:
    with open(log, encoding="utf-8", errors="replace") as f:
        text = f.read()
    last = text.rfind("::: block ")
    part = text[last:] if last >= 0 else text
    return part[-chars:]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--venv", default=os.path.join(REPO, ".venv"),
                   help="environment the clone's .venv links to, replacing the README's install step "
                        "(default: this checkout's .venv); 'none': run the install step as written")
    p.add_argument("--only", action="append", help="run only this document (README.md, data.md, ...); repeatable")
    p.add_argument("--workdir", help="where to clone (default: a new temporary directory, removed after a pass)")
    p.add_argument("--keep", action="store_true", help="keep the work directory after a pass too")
    p.add_argument("--list", action="store_true", help="print the bash blocks and exit")
    p.add_argument("--timeout", type=float, default=DOC_TIMEOUT_S, help="seconds per document")
    p.add_argument("--outputs", help="write here a JSON object: each document run -> the files it created "
                                      "(paths relative to the clone), for a check across documents run apart")
    p.add_argument("--total-timeout", type=float, default=None,
                   help="seconds for all the documents together (default: no limit but --timeout's); the "
                        "document running at the limit is stopped and reported as timed out")
    args = p.parse_args(argv)

    blocks = bash_blocks(REPO, args.only)
    if args.list:
        for b in blocks:
            print(f"{b.where}" + (f"  [not-run: {b.skip}]" if b.skip else ""))
        return 0
    if not blocks:
        print(f"error: --only {args.only}: no such document with bash blocks (have: {', '.join(documents())})",
              file=sys.stderr)
        return 2
    venv = None if args.venv == "none" else os.path.abspath(args.venv)
    if venv is not None and not os.path.exists(os.path.join(venv, "bin", "python")):
        print(f"error: --venv {args.venv}: no bin/python there; create the environment first (README's install "
              "command) or pass --venv none to install into the clone", file=sys.stderr)
        return 2

    work = os.path.abspath(args.workdir) if args.workdir else tempfile.mkdtemp(prefix="levanter-guides-")
    os.makedirs(work, exist_ok=True)
    clone = os.path.join(work, "levanter")
    if os.path.exists(clone):
        print(f"error: --workdir {work}: it already holds a clone ({clone}); give an empty directory", file=sys.stderr)
        return 2
    make_clone(REPO, clone)
    if venv is not None:
        os.symlink(venv, os.path.join(clone, ".venv"))
    print(f"fresh clone: {clone}" + (f" (.venv -> {venv})" if venv else ""))

    owner: Dict[str, str] = {}  # file -> the document that wrote it
    created: Dict[str, List[str]] = {}  # document -> the files it created
    before = snapshot(clone)
    baseline = set(_git_lines(clone, "status", "--porcelain"))  # the overlaid uncommitted changes
    failures = []
    t_all = time.time()
    by_doc: Dict[str, List[Block]] = {}
    for b in blocks:
        by_doc.setdefault(b.doc, []).append(b)
    for doc, doc_blocks in by_doc.items():
        t0 = time.time()
        print(f"{doc}:", flush=True)
        timeout = args.timeout
        if args.total_timeout is not None:
            timeout = max(1.0, min(timeout, args.total_timeout - (t0 - t_all)))
        ok, log = run_document(doc, doc_blocks, clone, work, skip_install=venv is not None, timeout=timeout)
        after = snapshot(clone)
        for path, stat in before.items():
            if path in SHARED_LOGS:
                continue
            if after.get(path) != stat:
                what = "deleted" if path not in after else "changed"
                failures.append(f"{doc} {what} {path}, " + (f"written by {owner[path]}" if path in owner
                                                               else "a file of the repository"))
                ok = False
        created[doc] = sorted(path for path in after if path not in before)
        for path in created[doc]:
            owner[path] = doc
        dirty = [line for line in _git_lines(clone, "status", "--porcelain") if line not in baseline]
        if dirty:
            failures.append(f"{doc} left files that are tracked-and-changed or not git-ignored: " + ", ".join(dirty[:10]))
            ok = False
        print(f"  {doc}: {'passed' if ok else 'FAILED'} in {time.time() - t0:.0f} s", flush=True)
        if not ok:
            failures.append(f"{doc}: a block failed; the end of its output ({log}):\n{tail_of_block(log)}")
            break
        before = after
    if args.outputs:
        with open(args.outputs, "w") as f:
            json.dump(created, f, indent=1)
    print(f"{'passed' if not failures else 'FAILED'}: {len([b for b in blocks if b.skip is None])} blocks run, "
          f"{len([b for b in blocks if b.skip])} marked not-run, {time.time() - t_all:.0f} s")
    for f in failures:
        print(f"error: {f}", file=sys.stderr)
    if failures or args.keep:
        print(f"work directory kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
