"""Rank timings per node and window (issue 18, docs/architecture.md "Step data").

On PostgreSQL the table is range-partitioned by ``reported_at`` with a DEFAULT partition, and this
migration creates the partition holding "now"; beat creates the rest (``jobs.tasks.maintain_node_windows``).
The SQL is written out here rather than taken from ``nodes.services.partitions``, so that this
migration stays what it was when the code moves on. Elsewhere (SQLite) it is a plain table.
"""

from datetime import UTC, datetime, timedelta

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models

WIDTH = timedelta(hours=1)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def create_table(apps, schema_editor):
    model = apps.get_model("jobs", "NodeWindow")
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.create_model(model)
        return
    quote = schema_editor.quote_name
    sql, params = schema_editor.table_sql(model)
    schema_editor.execute(f"{sql} PARTITION BY RANGE ({quote('reported_at')})", params or None)
    table = model._meta.db_table
    for index in model._meta.indexes:  # on the parent: every partition gets it
        schema_editor.add_index(model, index)
    schema_editor.execute(f"CREATE TABLE {quote(table + '_default')} PARTITION OF {quote(table)} DEFAULT")
    start = EPOCH + (django.utils.timezone.now() - EPOCH) // WIDTH * WIDTH
    schema_editor.execute(f"CREATE TABLE {quote(f'{table}_p{start:%Y%m%d%H}')} PARTITION OF {quote(table)} "
                          f"FOR VALUES FROM ('{start.isoformat()}') TO ('{(start + WIDTH).isoformat()}')")


def drop_table(apps, schema_editor):
    schema_editor.delete_model(apps.get_model("jobs", "NodeWindow"))  # partitions go along


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0007_efficiencytarget_poolprice'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(state_operations=[
            migrations.CreateModel(
                name='NodeWindow',
                fields=[
                    ('pk', models.CompositePrimaryKey('job', 'generation', 'node', 'last_step', 'reported_at',
                                                      blank=True, editable=False, primary_key=True,
                                                      serialize=False)),
                    ('generation', models.PositiveIntegerField()),
                    ('node', models.PositiveIntegerField()),
                    ('first_step', models.BigIntegerField()),
                    ('last_step', models.BigIntegerField()),
                    ('ranks', models.PositiveIntegerField()),
                    ('step_median_s', models.FloatField()),
                    ('step_max_s', models.FloatField()),
                    ('slowest_rank', models.PositiveIntegerField()),
                    ('slowest_s', models.FloatField()),
                    ('slowest_phases', models.JSONField(blank=True, default=dict)),
                    ('phases', models.JSONField(blank=True, default=dict)),
                    ('reported_at', models.DateTimeField(
                        help_text="The exchange that closed the window, by rank 0's clock.")),
                    ('received_at', models.DateTimeField(default=django.utils.timezone.now)),
                    ('job', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE,
                                              related_name='node_windows', to='jobs.job')),
                ],
                options={
                    'ordering': ['job', 'generation', 'last_step', 'node'],
                    'indexes': [models.Index(fields=['job', 'generation', 'last_step'], name='nodewindow_newest')],
                },
            ),
        ]),
        migrations.RunPython(create_table, drop_table),
    ]
