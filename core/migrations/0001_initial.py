# The audit log moves from jobs to core without moving a row: this creates the model in the
# migration state only, on the table jobs/migrations/0001_initial.py created (jobs_event).

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('jobs', '0004_launch_module'),
        ('nodes', '0001_initial'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='Event',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('created_at', models.DateTimeField(db_index=True, default=django.utils.timezone.now)),
                        ('kind', models.CharField(db_index=True, help_text='e.g. job.state, node.drain, job.launch', max_length=48)),
                        ('actor', models.CharField(help_text='user:…, token:…, node:… or system:…', max_length=200)),
                        ('generation', models.PositiveIntegerField(blank=True, null=True)),
                        ('old_state', models.CharField(blank=True, max_length=24)),
                        ('new_state', models.CharField(blank=True, max_length=24)),
                        ('reason', models.TextField(blank=True)),
                        ('evidence', models.JSONField(blank=True, default=dict)),
                        ('job', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='events', to='jobs.job')),
                        ('node', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='events', to='nodes.node')),
                    ],
                    options={
                        'db_table': 'jobs_event',
                        'ordering': ['created_at', 'pk'],
                        'indexes': [models.Index(fields=['job', 'created_at'], name='event_job_time')],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
