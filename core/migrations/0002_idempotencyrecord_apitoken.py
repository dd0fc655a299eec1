# Credentials and the idempotency ledger move from controlplane to core without moving a row: the
# models are created in the migration state only, on the tables controlplane created.

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('core', '0001_initial'),
        ('controlplane', '0002_apitoken_job_scope'),
        ('jobs', '0006_paper_states_removed'),
        ('nodes', '0003_slurm'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='IdempotencyRecord',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('owner', models.CharField(max_length=80)),
                        ('key', models.CharField(max_length=200)),
                        ('request_digest', models.CharField(max_length=64)),
                        ('status_code', models.PositiveSmallIntegerField()),
                        ('response', models.JSONField()),
                        ('created_at', models.DateTimeField(db_index=True, default=django.utils.timezone.now)),
                    ],
                    options={
                        'db_table': 'controlplane_idempotencyrecord',
                        'constraints': [models.UniqueConstraint(fields=('owner', 'key'), name='idempotency_owner_key')],
                    },
                ),
                migrations.CreateModel(
                    name='ApiToken',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('name', models.CharField(max_length=100)),
                        ('scope', models.CharField(choices=[('viewer', 'viewer (read only)'), ('ci', 'CI pipeline (launch and read jobs)'), ('operator', 'operator'), ('oncall', 'on-call'), ('agent', 'node agent'), ('bootstrap', 'one-time agent bootstrap'), ('job', 'one generation of one job (training hooks)')], max_length=16)),
                        ('digest', models.CharField(max_length=64, unique=True)),
                        ('prefix', models.CharField(max_length=12)),
                        ('generation', models.PositiveIntegerField(blank=True, null=True)),
                        ('hostname', models.CharField(blank=True, max_length=253)),
                        ('single_use', models.BooleanField(default=False)),
                        ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                        ('expires_at', models.DateTimeField(blank=True, null=True)),
                        ('last_used_at', models.DateTimeField(blank=True, null=True)),
                        ('revoked_at', models.DateTimeField(blank=True, null=True)),
                        ('job', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='tokens', to='jobs.job')),
                        ('node', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='tokens', to='nodes.node')),
                        ('user', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='api_tokens', to=settings.AUTH_USER_MODEL)),
                    ],
                    options={
                        'db_table': 'controlplane_apitoken',
                        'indexes': [models.Index(fields=['job', 'generation'], name='apitoken_job_generation')],
                        'constraints': [models.CheckConstraint(condition=models.Q(models.Q(('scope', 'agent'), _negated=True), ('node__isnull', False), _connector='OR'), name='agent_token_has_node'), models.CheckConstraint(condition=models.Q(models.Q(('scope', 'job'), _negated=True), models.Q(('generation__isnull', False), ('job__isnull', False)), _connector='OR'), name='job_token_has_job_and_generation'), models.CheckConstraint(condition=models.Q(('scope', 'job'), models.Q(('generation__isnull', True), ('job__isnull', True)), _connector='OR'), name='only_job_token_has_job')],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
