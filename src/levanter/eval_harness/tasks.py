"""Finding and loading lm-evaluation-harness tasks: local YAMLs first, the harness's own when needed.

Task names resolve against, in order, ``eval_harness.include_path`` (directories of task YAMLs in the
harness's custom-task format: a YAML naming its data, e.g. ``dataset_path: json`` with
``dataset_kwargs.data_files``), the tasks shipped with levanter (:data:`SHIPPED_TASKS`), then the
harness's built-in tasks. Indexing the harness's ~15,000 built-in task files takes seconds, so it is skipped
when every requested name is local.

A task whose data lives on the Hugging Face Hub needs the network; without it (``HF_HUB_OFFLINE=1``, or no
route) its load fails, and that is one error naming the task and the two ways out (a connection, or a
local copy of the task). A task that generates text (``output_type: generate_until``) is refused before
anything runs.
"""

from __future__ import annotations

import difflib
import os
from typing import Any, Dict, List, Sequence, Union

from levanter.eval_harness.config import TaskConfig
from levanter.eval_harness.local_data import SHIPPED_TASKS_DIR

__all__ = ["SHIPPED_TASKS", "check_include_path", "load_task", "make_task_manager",
           "shipped_task_names"]

# Tasks shipped with levanter (their YAML and data in SHIPPED_TASKS_DIR): they run offline.
SHIPPED_TASKS = ("levanter_mc", "levanter_ppl")


def shipped_task_names() -> List[str]:
    return sorted(n[:-5] for n in os.listdir(SHIPPED_TASKS_DIR) if n.endswith(".yaml"))


def check_include_path(include_path: Sequence[str], key: str = "eval_harness.include_path") -> List[str]:
    """The directories of ``include_path``, absolute; a missing one is an error naming the key."""
    out = []
    for i, p in enumerate(include_path):
        path = os.path.abspath(os.path.expanduser(p))
        if not os.path.isdir(path):
            raise ValueError(f"{key}.{i}={p!r} is not a directory: give directories of task YAML files")
        out.append(path)
    return out


def make_task_manager(task_spec: Sequence[Union[str, TaskConfig]], include_path: Sequence[str] = ()):
    """An ``lm_eval.tasks.TaskManager`` over ``include_path`` and the shipped tasks, with the harness's own
    tasks indexed too unless every task of ``task_spec`` is found without them."""
    from lm_eval.tasks import TaskManager

    paths = [SHIPPED_TASKS_DIR, *check_include_path(include_path)]
    local = TaskManager(include_path=paths, include_defaults=False)
    wanted = [t if isinstance(t, str) else t.task for t in task_spec]
    if all(w in local.all_tasks for w in wanted):
        return local
    return TaskManager(include_path=paths)


def load_task(manager, task: Union[str, TaskConfig], where: str) -> Dict[str, Any]:
    """The harness's loaded tasks of one ``task_spec`` entry (``manager.load``'s dict: ``tasks``,
    ``groups``, ...), with its documents. ``where`` is the entry's config key, for errors."""
    name = task if isinstance(task, str) else task.task
    if name not in manager.all_tasks:
        close = difflib.get_close_matches(name, manager.all_tasks, n=3)
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise ValueError(
            f"{where}: no lm-evaluation-harness task is named {name!r}{hint}. Name one of the harness's tasks, one "
            f"shipped with levanter ({', '.join(SHIPPED_TASKS)}), or one in a directory of eval_harness.include_path"
        )
    try:
        loaded = manager.load([name])
    except Exception as e:  # noqa: BLE001 -- the harness and datasets raise many kinds for one cause
        raise _load_error(name, where, e) from None
    # A TaskConfig's settings go onto each loaded task (a group's subtasks too), as the harness's own
    # simple_evaluate sets num_fewshot: a dict given to the harness would be read as a whole new task.
    overrides = {} if isinstance(task, str) else {k: v for k, v in task.to_dict().items() if k != "task"}
    for t in loaded["tasks"].values():
        for key, value in overrides.items():
            t.set_config(key=key, value=value)
    generating = sorted(n for n, t in loaded["tasks"].items() if t.get_config("output_type") == "generate_until")
    if generating:
        raise ValueError(
            f"{where}: task {', '.join(map(repr, generating))} generates text (output_type: generate_until), which "
            "levanter does not evaluate (it scores log-likelihoods): remove it from eval_harness.task_spec"
        )
    return loaded


_NETWORK_WORDS = ("offline", "connection", "couldn't reach", "could not reach", "resolve", "network", "timed out",
                  "max retries", "hub", "huggingface.co", "name or service not known", "temporary failure")


def _load_error(name: str, where: str, e: Exception) -> ValueError:
    text = f"{type(e).__name__}: {e}"
    if any(w in text.lower() for w in _NETWORK_WORDS):
        return ValueError(
            f"{where}: task {name!r} reads its data from the Hugging Face Hub, which cannot be reached ({text[:300]}). "
            "Run where the Hub is reachable (with HF_HUB_OFFLINE unset), or make the task local: write its YAML with "
            "dataset_path: json and dataset_kwargs.data_files naming JSON-lines files, put it in a directory, and "
            "add that directory to eval_harness.include_path (docs/guides/evaluation.md)"
        )
    return ValueError(f"{where}: task {name!r} could not be loaded ({text[:500]})")

