# The efficiency targets and pool prices move from alerts to jobs with the efficiency figures
# (jobs.efficiency) without moving a row: this creates the models in the migration state only, on
# the tables alerts/migrations/0001_initial.py created (alerts_efficiencytarget, alerts_poolprice).

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0006_paper_states_removed'),
        ('alerts', '0002_encrypted_secret_scrubbed_errors'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='PoolPrice',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('pool', models.CharField(max_length=100, unique=True)),
                        ('price_per_gpu_hour', models.DecimalField(decimal_places=4, max_digits=10)),
                        ('currency', models.CharField(default='USD', max_length=3)),
                    ],
                    options={
                        'db_table': 'alerts_poolprice',
                        'ordering': ['pool'],
                    },
                ),
                migrations.CreateModel(
                    name='EfficiencyTarget',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('expected_mfu', models.FloatField(blank=True, help_text='0-1. The MFU alert fires below this less the margin.', null=True)),
                        ('mfu_margin', models.FloatField(blank=True, help_text="Relative margin, e.g. 0.2 = alert below 80% of the expected MFU. Default: NIGHTWATCH['EFFICIENCY']['MFU_MARGIN'].", null=True)),
                        ('flops_per_token', models.FloatField(blank=True, help_text="Overrides the hooks' figure (default 6 x parameters).", null=True)),
                        ('job', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, related_name='efficiency_target', to='jobs.job')),
                    ],
                    options={
                        'db_table': 'alerts_efficiencytarget',
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
