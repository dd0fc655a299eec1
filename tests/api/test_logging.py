"""Structured logs: one JSON object per line, carrying the job, generation, node and incident ids
of the work at hand — in web requests, Celery tasks and the agent — and never a token, a secret
or a payload field."""

from __future__ import annotations

import io
import json
import logging

import pytest

from agents.jsonlog import JsonFormatter, log_context, redact


def format_one(formatter, message: str, *args, **extra) -> dict:
    record = logging.LogRecord("nightwatch.test", logging.INFO, __file__, 1, message, args, None)
    for key, value in extra.items():
        setattr(record, key, value)
    return json.loads(formatter.format(record))


def test_lines_carry_bound_and_passed_ids_and_nothing_else():
    formatter = JsonFormatter(service="agent", static={"node": "gpu-01"})
    with log_context(job=7, generation=3):
        line = format_one(formatter, "rank %d exited", 1, incident=12, prompt="the secret prompt",
                          samples=[1, 2, 3])
    assert line["message"] == "rank 1 exited"
    assert (line["service"], line["node"], line["job"], line["generation"], line["incident"]) == \
        ("agent", "gpu-01", 7, 3, 12)
    assert "prompt" not in line and "samples" not in line and "the secret prompt" not in json.dumps(line)
    assert "job" not in format_one(formatter, "outside the block")


def test_tokens_and_secrets_are_masked():
    text = redact("Authorization: Bearer nw_abcdefghijklmnop12345 password=hunter2hunter2 token: xyzxyzxyzxyzxyz")
    assert "nw_abcdefghijklmnop12345" not in text and "hunter2hunter2" not in text and "xyzxyzxyzxyzxyz" not in text
    line = format_one(JsonFormatter(), "registered with %s", "nw_abcdefghijklmnop12345")
    assert "abcdefghijklmnop" not in line["message"]


def test_celery_task_arguments_become_ids():
    from core.logs import task_ids
    from jobs.tasks import handle_exit

    handle_exit.push_request(id="task-1", args=[7, 2, "gpu-01", {"exit_code": 1}], kwargs={})
    try:
        assert task_ids(handle_exit) == {"task": "jobs.tasks.handle_exit", "task_id": "task-1", "job": 7,
                                         "generation": 2, "node": "gpu-01"}
    finally:
        handle_exit.pop_request()


@pytest.mark.django_db
def test_a_web_request_logs_with_the_ids_in_its_url(cast, api):
    from core.logs import ControlPlaneJsonFormatter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(ControlPlaneJsonFormatter(service="control-plane"))
    logger = logging.getLogger("django.request")
    logger.addHandler(handler)
    try:
        assert api(cast.tokens["viewer"]).get("/api/v1/jobs/424242/status").status_code == 404
        assert api(cast.tokens["viewer"]).get("/api/v1/nodes/515151").status_code == 404
    finally:
        logger.removeHandler(handler)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert {(line.get("job"), line.get("node"), line.get("method")) for line in lines} == {
        (424242, None, "GET"), (None, 515151, "GET")}
    assert cast.tokens["viewer"] not in stream.getvalue()
