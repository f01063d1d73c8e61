"""The ``eval_harness:`` section: which lm-evaluation-harness tasks to run on a model, and how.

Upstream Levanter's keys (``task_spec``, ``max_examples``, ``max_eval_length``, ``log_samples``,
``bootstrap_iters``, ``apply_chat_template``) keep their names and meaning; ``include_path`` is the
harness's own name for directories of local task YAMLs. Nothing here imports ``lm_eval``: a config that
never runs the harness parses and validates without the ``eval`` extra installed.

A task is a name the harness knows (``piqa``, ``mmlu``, a task in ``include_path`` or one shipped with
levanter, :data:`levanter.eval_harness.tasks.SHIPPED_TASKS`), or a :class:`TaskConfig`: a name plus the
settings that change it (few-shot examples, prompt templates) and the alias its results are logged under,
so that one task can run twice with different settings (``hellaswag`` 0-shot and 10-shot).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Union

__all__ = ["LmEvalHarnessConfig", "TaskConfig", "task_name"]


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """One task of ``eval_harness.task_spec`` with settings of its own (unset ones keep the task's)."""

    # The harness's name of the task (or of a group of tasks, such as mmlu).
    task: str
    # The name its results are logged under (lm_eval/<alias>/<metric>); null: the task's own name.
    task_alias: Optional[str] = None
    # Worked examples put before each question; null: the task's default.
    num_fewshot: Optional[int] = None
    # A promptsource prompt by name, replacing doc_to_text, doc_to_target and doc_to_choice.
    use_prompt: Optional[str] = None
    # Text (a Jinja2 template) put before the few-shot examples.
    description: Optional[str] = None
    # Text between a question and its answer; null: the task's (usually one space).
    target_delimiter: Optional[str] = None
    # Text between few-shot examples; null: the task's (usually a blank line).
    fewshot_delimiter: Optional[str] = None
    # Jinja2 template turning a document into the model's input.
    doc_to_text: Optional[str] = None
    # Jinja2 template turning a document into its answer (or the answer's index among the choices).
    doc_to_target: Optional[str] = None
    # Upstream's spelling of doc_to_target (its TaskConfig misspells the key); the same setting.
    doct_to_target: Optional[str] = None
    # Jinja2 template turning a document into its list of choices (multiple-choice tasks).
    doc_to_choice: Optional[str] = None

    def to_dict(self) -> dict:
        """The harness's task dict: the set settings only (the harness's defaults stand for the rest), with
        ``doct_to_target`` under its real name."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        if "doct_to_target" in out:
            out.setdefault("doc_to_target", out.pop("doct_to_target"))
        return out


def task_name(task: Union[str, TaskConfig]) -> str:
    """The name a task's results are logged under: its alias, else its name."""
    if isinstance(task, str):
        return task
    return task.task_alias or task.task


@dataclasses.dataclass(frozen=True)
class LmEvalHarnessConfig:
    """lm-evaluation-harness tasks run on the model (during training: every ``eval_harness_steps`` steps)."""

    # Tasks to run: names (piqa, hellaswag, mmlu, or a task of include_path) or {task, task_alias,
    # num_fewshot, ...} entries.
    task_spec: List[Union[TaskConfig, str]] = dataclasses.field(default_factory=list)
    # Documents per task (the first ones of its evaluation split); null: all of them.
    max_examples: Optional[int] = None
    # Tokens per packed evaluation sequence (long requests keep their last tokens); null: model.seq_len.
    max_eval_length: Optional[int] = None
    # Keep every document's requests and answers in the results JSON (large).
    log_samples: bool = False
    # Bootstrap resamples for the metrics' standard errors; 0: none (faster).
    bootstrap_iters: int = 0
    # Put each prompt through the tokenizer's chat template (a chat model's format) before scoring it.
    apply_chat_template: bool = False
    # Directories of local task YAMLs (the harness's include_path), searched before its own tasks.
    include_path: List[str] = dataclasses.field(default_factory=list)

    def task_names(self) -> List[str]:
        return [task_name(t) for t in self.task_spec]

    def to_task_spec(self) -> list:
        """``task_spec`` as the harness takes it: names, and dicts for :class:`TaskConfig` entries."""
        return [t if isinstance(t, str) else t.to_dict() for t in self.task_spec]

    def validate(self, prefix: str = "eval_harness") -> None:
        """Checks that need neither the harness nor the tasks: each error names the key."""
        if not self.task_spec:
            raise ValueError(f"{prefix}.task_spec is empty: name at least one task (e.g. task_spec: [piqa])")
        names = self.task_names()
        for i, (t, name) in enumerate(zip(self.task_spec, names)):
            if not isinstance(t, (str, TaskConfig)) or not name or not str(name).strip():
                raise ValueError(f"{prefix}.task_spec.{i}: a task needs a name, got {t!r}")
            if isinstance(t, TaskConfig) and t.doc_to_target and t.doct_to_target and t.doc_to_target != t.doct_to_target:
                raise ValueError(f"{prefix}.task_spec.{i}: doc_to_target and doct_to_target (upstream's spelling of "
                                 "the same key) disagree; keep one")
            if isinstance(t, TaskConfig) and t.num_fewshot is not None and t.num_fewshot < 0:
                raise ValueError(f"{prefix}.task_spec.{i}.num_fewshot must be >= 0, got {t.num_fewshot}")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"{prefix}.task_spec names {dup[0]!r} twice: give one of them a task_alias, so that "
                             "their results are logged apart")
        if self.max_examples is not None and self.max_examples < 1:
            raise ValueError(f"{prefix}.max_examples must be >= 1, or null for every document, got {self.max_examples}")
        if self.max_eval_length is not None and self.max_eval_length < 2:
            raise ValueError(f"{prefix}.max_eval_length must be >= 2 tokens, got {self.max_eval_length}")
        if self.bootstrap_iters < 0:
            raise ValueError(f"{prefix}.bootstrap_iters must be >= 0, got {self.bootstrap_iters}")
