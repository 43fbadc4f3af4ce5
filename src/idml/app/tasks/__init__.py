"""Tasks: what a run learns and how it is judged, the application's extension point.

:data:`TASKS` holds every task by the name a config's ``task.name`` gives it; the trainer, the CLI
(``evaluate``, ``embed``) and the report ask a run's task for what differs between tasks and never
compare task names (:class:`Task` lists what a task owns). Two tasks ship:

- ``metric_learning`` (:mod:`idml.app.tasks.metric_learning`): class-disjoint retrieval with a
  metric loss (the IDML and SSR papers' protocol);
- ``classification`` (:mod:`idml.app.tasks.classification`): a cosine classifier, ISM inside it,
  on a split with every class on both sides.

A new task is one module and one :func:`register_task` line below (or in your own code, before the
config is read; README, "Adding a task").
"""

from idml.app.tasks._base import (
    Evaluation,
    EvaluationContext,
    EvaluationRequest,
    LoadedRun,
    MetricsTable,
    Objective,
    RunEvaluation,
    Task,
    TaskParams,
)
from idml.app.tasks._registry import (
    TASKS,
    register_task,
    task_of,
    task_of_run,
    unregister_task,
)
from idml.app.tasks.classification import Classification
from idml.app.tasks.metric_learning import MetricLearning

register_task(MetricLearning())
register_task(Classification())

__all__ = [
    "TASKS",
    "Evaluation",
    "EvaluationContext",
    "EvaluationRequest",
    "LoadedRun",
    "MetricsTable",
    "Objective",
    "RunEvaluation",
    "Task",
    "TaskParams",
    "register_task",
    "task_of",
    "task_of_run",
    "unregister_task",
]
