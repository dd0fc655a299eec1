"""The job spec file of ``nightwatch launch``: every problem named with its line and field."""

from __future__ import annotations

import textwrap

import pytest

from agents.cli import spec as specs


def write(tmp_path, text: str):
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def problems(tmp_path, text: str) -> list[tuple[int, str, str]]:
    with pytest.raises(specs.SpecError) as caught:
        specs.load(write(tmp_path, text))
    return [(p.line, p.field, p.reason) for p in caught.value.problems]


def test_a_valid_spec_becomes_the_launch_body(tmp_path):
    spec = specs.load(write(tmp_path, """
        name: tiny-lm
        entrypoint: examples/train.py
        args: [--steps, 40, --lr, 1e-3]
        nproc_per_node: 2
        accelerator: cpu
        nccl_profile: {NCCL_DEBUG: WARN}
        checkpoint_policy:
          interval: auto
          keep_last: 2
        recovery_policy:
          progress_timeout_s: null
          allow_shrink: true
    """))
    assert spec.body == {"name": "tiny-lm", "entrypoint": "examples/train.py",
                         "args": ["--steps", "40", "--lr", "1e-3"], "nproc_per_node": 2, "accelerator": "cpu",
                         "nccl_profile": {"NCCL_DEBUG": "WARN"},
                         "checkpoint_policy": {"interval": "auto", "keep_last": 2},
                         "recovery_policy": {"progress_timeout_s": None, "allow_shrink": True}}
    assert spec.locate("recovery_policy.allow_shrink") == 12
    assert spec.locate("args.3") == 3
    assert spec.locate("checkpoint_policy.nonexistent") == 7


def test_every_problem_is_reported_with_its_line(tmp_path):
    found = problems(tmp_path, """
        name: tiny-lm
        entrypont: examples/train.py
        nproc_per_node: two
        accelerator: tpu
        recovery_policy:
          max_restart: 3
          allow_shrink: maybe
        nccl_profile: {NCCL_DEBG: INFO}
    """)
    assert found == [
        (1, "entrypoint", "required (or module: a module to run as python -m)"),
        (2, "entrypont", "unknown field; did you mean 'entrypoint'?"),
        (3, "nproc_per_node", "expected an integer, got 'two'"),
        (4, "accelerator", "expected one of gpu, cpu, got 'tpu'"),
        (6, "recovery_policy.max_restart", "unknown field; did you mean 'recovery_policy.max_restarts'?"),
        (7, "recovery_policy.allow_shrink", "expected true or false, got 'maybe'"),
        (8, "nccl_profile", found[-1][2]),
    ]
    assert "NCCL_DEBG" in found[-1][2] and "NCCL_DEBUG" in found[-1][2]


def test_broken_yaml_and_wrong_shapes(tmp_path):
    assert problems(tmp_path, "name: [unclosed\n")[0][0] == 2
    assert problems(tmp_path, "- just\n- a list\n") == [(1, "", "the spec must be a mapping of fields "
                                                               "(name: …, entrypoint: …)")]
    assert problems(tmp_path, "name: a\nentrypoint: t.py\nargs: --steps 4\n") == [
        (3, "args", "expected a list of arguments")]
    assert problems(tmp_path, "name: a\nname: b\nentrypoint: t.py\n") == [(2, "name", "given twice")]


def test_a_module_instead_of_a_script(tmp_path):
    spec = specs.load(write(tmp_path, "name: a\nmodule: pkg.train\nargs: ['  --lr ', '1e-3']\n"))
    assert spec.body == {"name": "a", "module": "pkg.train", "args": ["  --lr ", "1e-3"]}  # verbatim
    assert problems(tmp_path, "name: a\nentrypoint: t.py\nmodule: pkg.train\n") == [
        (3, "module", "give entrypoint or module, not both")]


@pytest.mark.parametrize(("line", "field", "reason"), [
    ("entrypoint: --no-python", "entrypoint", "relative path to a .py file"),
    ("entrypoint: /etc/train.py", "entrypoint", "relative path to a .py file"),
    ("entrypoint: ../train.py", "entrypoint", "relative path to a .py file"),
    ("module: -m pkg", "module", "dotted Python module name"),
    ("module: pdb", "module", "standard-library module"),
    ("nccl_profile: {NCCL_DEBUG_FILE: /tmp/x}", "nccl_profile", "bare file name"),
])
def test_an_injected_target_is_refused_by_the_agents_own_rules(tmp_path, line, field, reason):
    text = "name: a\n" + line + "\n" + ("entrypoint: t.py\n" if line.startswith("nccl") else "")
    [(at, named, why)] = problems(tmp_path, text)
    assert (at, named) == (2, field) and reason in why


def test_the_message_reads_file_line_field(tmp_path):
    with pytest.raises(specs.SpecError) as caught:
        specs.load(write(tmp_path, "name: a\nentrypoint: t.py\nnnodes: many\n"))
    assert str(caught.value) == f"{tmp_path / 'job.yaml'}:3: nnodes: expected an integer, got 'many'"


def test_the_cli_never_imports_django():
    import subprocess
    import sys

    code = "import sys, agents.cli.__main__; sys.exit('django' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=60).returncode == 0
