"""The job spec file (YAML) of ``nightwatch launch``, checked with messages that name the line.

The file holds what ``POST /api/v1/jobs`` accepts::

    name: tiny-lm                    # letters, digits, . _ -
    entrypoint: examples/train.py    # a .py file, relative to the nodes' code directory
    # module: pkg.train              # or, instead of entrypoint: a module of it, run as python -m
    args: [--steps, 40]              # passed verbatim after the script
    nnodes: 1
    nproc_per_node: 2
    accelerator: cpu                 # gpu (nccl) or cpu (gloo)
    checkpoint_policy: {interval_steps: 10, keep_last: 3}
    recovery_policy: {max_restarts: 5, backoff_seconds: 5}

Here the shape is checked (known keys, types, enums, the script or module and the NCCL profile
with the agent's own rules from ``agents.protocol``); the ranges and the rest are the server's
rules, and a refusal from the server names its field, which ``locate`` maps back to the line of
the file. So every complaint reads ``job.yaml:7: recovery_policy.max_restarts: …``, wherever it was found.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from agents.protocol.agent import LaunchSpecError, module_problem, script_problem, validate_nccl_profile

STR, INT, BOOL = "a string", "an integer", "true or false"

CHECKPOINT_POLICY = {"dir": STR, "replica_dir": STR, "interval": ("fixed", "auto"), "interval_steps": INT,
                     "keep_last": INT, "permanent_every_hours": INT, "min_free_percent": INT,
                     "release_permanent_under_pressure": BOOL, "snapshot_every": INT}
RECOVERY_POLICY = {"max_restarts": INT, "window_minutes": INT, "backoff_seconds": INT, "allow_shrink": BOOL,
                   "progress_timeout_s": INT, "startup_timeout_s": INT, "loss_spike_limit": INT,
                   "clean_run_minutes": INT, "max_steps": INT, "max_step_jump": INT,
                   "inprocess_restarts": INT}
TOP_LEVEL = {"name": STR, "entrypoint": STR, "module": STR, "args": "args", "nnodes": INT, "nproc_per_node": INT,
             "accelerator": ("gpu", "cpu"), "rdzv_port": INT, "nccl_profile": "nccl_profile",
             "checkpoint_policy": CHECKPOINT_POLICY, "recovery_policy": RECOVERY_POLICY, "queue": BOOL}
REQUIRED = ("name",)
#: What torchrun runs: exactly one of these, each checked by the agent's own rule.
TARGETS = {"entrypoint": script_problem, "module": module_problem}
#: may be null: the server derives the value
NULLABLE = {"checkpoint_policy.interval_steps",
            "recovery_policy.progress_timeout_s", "recovery_policy.startup_timeout_s", "recovery_policy.max_steps"}


@dataclass
class Problem:
    line: int
    field: str
    reason: str


@dataclass
class SpecError(Exception):
    path: str
    problems: list[Problem] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(f"{self.path}:{p.line}: {p.field + ': ' if p.field else ''}{p.reason}"
                         for p in self.problems)


@dataclass
class Spec:
    path: str
    body: dict
    lines: dict[str, int]  # dotted field -> line (1-based)

    def locate(self, dotted: str) -> int:
        """The line of ``dotted`` (a server's ``errors[].field``), or of its nearest parent."""
        parts = dotted.split(".") if dotted else []
        while parts:
            if ".".join(parts) in self.lines:
                return self.lines[".".join(parts)]
            parts.pop()
        return 1


def load(path: str | Path) -> Spec:
    """Parse and check a spec file; raises ``SpecError`` listing every problem with its line."""
    name = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SpecError(name, [Problem(0, "", f"cannot read the file: {exc.strerror or exc}")]) from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        raise SpecError(name, [Problem(line, "", f"not valid YAML: {getattr(exc, 'problem', None) or exc}")]) from None
    if root is None or not isinstance(root, yaml.MappingNode):
        raise SpecError(name, [Problem(1, "", "the spec must be a mapping of fields (name: …, entrypoint: …)")])
    lines: dict[str, int] = {}
    problems: list[Problem] = []
    body = _mapping(root, TOP_LEVEL, "", lines, problems)
    for required in REQUIRED:
        if required not in body and not any(p.field == required for p in problems):
            problems.append(Problem(root.start_mark.line + 1, required, "required"))
    problems.extend(_target_problems(body, lines, root.start_mark.line + 1, problems))
    if problems:
        raise SpecError(name, sorted(problems, key=lambda p: p.line))
    return Spec(name, body, lines)


def _target_problems(body: dict, lines: dict, top: int, found: list) -> list[Problem]:
    given = [key for key in TARGETS if key in body]
    if len(given) > 1:
        return [Problem(lines["module"], "module", "give entrypoint or module, not both")]
    if not given:
        if any(p.field in TARGETS for p in found):
            return []  # already reported (wrong type)
        return [Problem(top, "entrypoint", "required (or module: a module to run as python -m)")]
    key = given[0]
    problem = TARGETS[key](body[key])
    return [Problem(lines[key], key, problem)] if problem else []


def _mapping(node, schema: dict, prefix: str, lines: dict, problems: list) -> dict:
    out: dict = {}
    for key_node, value_node in node.value:
        key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node)
        dotted = f"{prefix}{key}"
        line = key_node.start_mark.line + 1
        lines[dotted] = line
        if key in out:
            problems.append(Problem(line, dotted, "given twice"))
            continue
        if key not in schema:
            close = difflib.get_close_matches(key, list(schema), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; known: {', '.join(schema)}"
            problems.append(Problem(line, dotted, f"unknown field{hint}"))
            continue
        kind = schema[key]
        if isinstance(kind, dict):
            if not isinstance(value_node, yaml.MappingNode):
                problems.append(Problem(line, dotted, "expected a mapping of fields"))
                continue
            out[key] = _mapping(value_node, kind, dotted + ".", lines, problems)
        elif kind == "args":
            out[key] = _args(value_node, dotted, lines, problems)
        elif kind == "nccl_profile":
            out[key] = _nccl(value_node, dotted, problems)
        else:
            value = _scalar(value_node, kind, dotted, problems)
            if value is not _INVALID:
                out[key] = value
    return out


_INVALID = object()


def _constructed(node):
    return yaml.SafeLoader(yaml.safe_dump(None)).construct_object(node, deep=True)


def _scalar(node, kind, dotted: str, problems: list):
    line = node.start_mark.line + 1
    if not isinstance(node, yaml.ScalarNode):
        problems.append(Problem(line, dotted, f"expected {kind if isinstance(kind, str) else 'a value'}, "
                                              "got a list or mapping"))
        return _INVALID
    value = _constructed(node)
    if value is None and dotted in NULLABLE:
        return None
    if kind == STR and isinstance(value, str) and value:
        return value
    if kind == INT and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind == BOOL and isinstance(value, bool):
        return value
    if isinstance(kind, tuple) and value in kind:
        return value
    expected = f"one of {', '.join(kind)}" if isinstance(kind, tuple) else kind
    problems.append(Problem(line, dotted, f"expected {expected}, got {node.value!r}"))
    return _INVALID


def _args(node, dotted: str, lines: dict, problems: list) -> list[str]:
    if not isinstance(node, yaml.SequenceNode):
        problems.append(Problem(node.start_mark.line + 1, dotted, "expected a list of arguments"))
        return []
    out = []
    for index, item in enumerate(node.value):
        lines[f"{dotted}.{index}"] = item.start_mark.line + 1
        if not isinstance(item, yaml.ScalarNode) or _constructed(item) is None:
            problems.append(Problem(item.start_mark.line + 1, f"{dotted}.{index}", "expected a single value"))
            continue
        out.append(item.value)  # as written: 40 stays "40", 1e-3 stays "1e-3"
    return out


def _nccl(node, dotted: str, problems: list) -> dict:
    line = node.start_mark.line + 1
    if not isinstance(node, yaml.MappingNode):
        problems.append(Problem(line, dotted, "expected a mapping of environment variables"))
        return {}
    profile = {str(k.value): str(v.value) for k, v in node.value if isinstance(v, yaml.ScalarNode)}
    try:
        return validate_nccl_profile(profile)
    except LaunchSpecError as exc:
        problems.append(Problem(line, dotted, str(exc)))
        return {}
