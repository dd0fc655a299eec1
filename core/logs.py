"""The control plane's JSON log format: ``agents.jsonlog`` plus the ids of the running Celery task.

Tasks take primary keys (``handle_exit(job_id, generation, …)``), so the ids a worker's lines
should carry are the task's own arguments: they are read from its signature at format time, with
no change to any task. Web requests get theirs from ``core.middleware``.
"""

from __future__ import annotations

import inspect
import logging

from celery import current_task

from agents.jsonlog import JsonFormatter

#: task parameter name -> log field
_TASK_IDS = {"job_id": "job", "job": "job", "generation": "generation", "node_id": "node", "node": "node",
             "hostname": "node", "incident_id": "incident", "checkpoint_id": "checkpoint"}


def task_ids(task) -> dict:
    """The ids among the running task's arguments, plus its name and id."""
    request = getattr(task, "request", None)
    if request is None or getattr(request, "id", None) is None:
        return {}
    found = {"task": task.name, "task_id": request.id}
    try:
        bound = inspect.signature(task.run).bind_partial(*(request.args or ()), **(request.kwargs or {}))
    except (TypeError, ValueError):
        return found
    for name, value in bound.arguments.items():
        field = _TASK_IDS.get(name)
        if field and isinstance(value, (int, str)) and not isinstance(value, bool):
            found[field] = value
    return found


class ControlPlaneJsonFormatter(JsonFormatter):
    def extra_context(self, record: logging.LogRecord) -> dict:
        task = current_task
        if not task:
            return {}
        return task_ids(task)
