"""Node windows keep their phase times as ``real[]`` in ``PHASES`` order instead of ``jsonb``
(``jobs.models.PhaseTimesField``): a third less per row (issue 18, docs/architecture.md "Step data").

On PostgreSQL the columns are converted in place (``ALTER ... TYPE ... USING``, which a partitioned
table passes to every partition). On SQLite the column stays text: the field writes a JSON list
there and still reads a dict written before.
"""

from django.db import migrations

import jobs.models

#: PHASES as they were when this migration was written (agents.protocol.hooks).
PHASES = ("input", "compute", "optimizer", "checkpoint")


def _to_arrays(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for column in ("phases", "slowest_phases"):
        items = ", ".join(f"({column} ->> '{name}')::real" for name in PHASES)
        schema_editor.execute(f"ALTER TABLE jobs_nodewindow ALTER COLUMN {column} TYPE real[] "
                              f"USING ARRAY[{items}]")


def _to_json(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for column in ("phases", "slowest_phases"):
        pairs = ", ".join(f"'{name}', {column}[{i}]" for i, name in enumerate(PHASES, start=1))
        schema_editor.execute(f"ALTER TABLE jobs_nodewindow ALTER COLUMN {column} TYPE jsonb "
                              f"USING jsonb_strip_nulls(jsonb_build_object({pairs}))")


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0011_training_logs"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(model_name="nodewindow", name="phases",
                                      field=jobs.models.PhaseTimesField(blank=True, default=dict)),
                migrations.AlterField(model_name="nodewindow", name="slowest_phases",
                                      field=jobs.models.PhaseTimesField(blank=True, default=dict)),
            ],
            database_operations=[migrations.RunPython(_to_arrays, _to_json)],
        ),
    ]
