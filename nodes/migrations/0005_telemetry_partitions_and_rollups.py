"""Telemetry in time partitions with minute rollups (issue 18, docs/architecture.md "Telemetry storage").

The per-GPU sample table (``GpuSample``, ~359 bytes a GPU sample, deleted row by row) is replaced
by ``NodeGpuSample`` (a row per node and moment, a value per GPU, ~44 bytes a GPU sample) and
``NodeGpuMinute`` (1-minute rollups, laid out the same way). The old rows are not carried over:
they are raw history that the new retention (48 h) would drop within two days anyway.

On PostgreSQL both tables are range-partitioned (raw by the hour, rollups by the day) with a
DEFAULT partition, and this migration creates the partition holding "now"; beat creates the rest
(``nodes.tasks.prepare_telemetry_partitions``). The SQL is written out here rather than taken from
``nodes.services.partitions``, so that this migration stays what it was when the code moves on.
Elsewhere (SQLite) they are plain tables.
"""

from datetime import UTC, datetime, timedelta

import django.db.models.deletion
from django.db import migrations, models
from django.utils import timezone

import nodes.models

#: model -> (partition column, one partition's range)
PARTITIONED = {"NodeGpuSample": ("time", timedelta(hours=1)), "NodeGpuMinute": ("minute", timedelta(days=1))}
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def create_tables(apps, schema_editor):
    quote = schema_editor.quote_name
    for name, (column, width) in PARTITIONED.items():
        model = apps.get_model("nodes", name)
        if schema_editor.connection.vendor != "postgresql":
            schema_editor.create_model(model)
            continue
        sql, params = schema_editor.table_sql(model)
        schema_editor.execute(f"{sql} PARTITION BY RANGE ({quote(column)})", params or None)
        table = model._meta.db_table
        schema_editor.execute(f"CREATE TABLE {quote(table + '_default')} PARTITION OF {quote(table)} DEFAULT")
        start = EPOCH + (timezone.now() - EPOCH) // width * width
        schema_editor.execute(f"CREATE TABLE {quote(f'{table}_p{start:%Y%m%d%H}')} PARTITION OF {quote(table)} "
                              f"FOR VALUES FROM ('{start.isoformat()}') TO ('{(start + width).isoformat()}')")


def drop_tables(apps, schema_editor):
    for name in PARTITIONED:
        schema_editor.delete_model(apps.get_model("nodes", name))  # a partitioned table takes its partitions along


class Migration(migrations.Migration):

    dependencies = [
        ('nodes', '0004_alter_slurmallocation_token'),
    ]

    operations = [
        migrations.DeleteModel(
            name='GpuSample',
        ),
        migrations.SeparateDatabaseAndState(state_operations=[
                migrations.CreateModel(
                    name='NodeGpuMinute',
                    fields=[
                        ('pk', models.CompositePrimaryKey('node', 'minute', blank=True, editable=False, primary_key=True, serialize=False)),
                        ('minute', models.DateTimeField()),
                        ('gpus', models.BigIntegerField(help_text='Bit i set: GPU i is in this row.')),
                        ('samples', nodes.models.PerGpuField(base_type='smallint')),
                        ('temperature_min', nodes.models.PerGpuField(base_type='smallint', null=True)),
                        ('temperature_mean', nodes.models.PerGpuField(base_type='real', null=True)),
                        ('temperature_max', nodes.models.PerGpuField(base_type='smallint', null=True)),
                        ('utilization_min', nodes.models.PerGpuField(base_type='smallint', null=True)),
                        ('utilization_mean', nodes.models.PerGpuField(base_type='real', null=True)),
                        ('utilization_max', nodes.models.PerGpuField(base_type='smallint', null=True)),
                        ('memory_used_mib_min', nodes.models.PerGpuField(base_type='integer', null=True)),
                        ('memory_used_mib_mean', nodes.models.PerGpuField(base_type='real', null=True)),
                        ('memory_used_mib_max', nodes.models.PerGpuField(base_type='integer', null=True)),
                        ('power_min', nodes.models.PerGpuField(base_type='smallint', null=True)),
                        ('power_mean', nodes.models.PerGpuField(base_type='real', null=True)),
                        ('power_max', nodes.models.PerGpuField(base_type='smallint', null=True)),
                        ('xid_total', nodes.models.PerGpuField(base_type='integer', null=True)),
                        ('ecc_uncorrected', nodes.models.PerGpuField(base_type='integer', null=True)),
                        ('nvlink_errors', nodes.models.PerGpuField(base_type='integer', null=True)),
                        ('node', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='minutes', to='nodes.node')),
                    ],
                    options={
                        'ordering': ['node', 'minute'],
                    },
                ),
                migrations.CreateModel(
                    name='NodeGpuSample',
                    fields=[
                        ('pk', models.CompositePrimaryKey('node', 'time', blank=True, editable=False, primary_key=True, serialize=False)),
                        ('time', models.DateTimeField()),
                        ('gpus', models.BigIntegerField(help_text='Bit i set: GPU i is in this row.')),
                        ('temperature_c', nodes.models.PerGpuField(base_type='smallint', null=True)),
                        ('utilization_pct', nodes.models.PerGpuField(base_type='smallint', null=True)),
                        ('memory_used_mib', nodes.models.PerGpuField(base_type='integer', null=True)),
                        ('power_w', nodes.models.PerGpuField(base_type='smallint', null=True)),
                        ('sm_clock_mhz', nodes.models.PerGpuField(base_type='smallint', null=True)),
                        ('xid_total', nodes.models.PerGpuField(base_type='integer', null=True)),
                        ('ecc_uncorrected', nodes.models.PerGpuField(base_type='integer', null=True)),
                        ('nvlink_errors', nodes.models.PerGpuField(base_type='integer', null=True)),
                        ('node', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='samples', to='nodes.node')),
                    ],
                    options={
                        'ordering': ['node', 'time'],
                    },
                ),
        ]),
        migrations.RunPython(create_tables, drop_tables),
    ]
