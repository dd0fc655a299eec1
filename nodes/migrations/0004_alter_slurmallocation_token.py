# The token model moved to core (same table): the foreign key follows it in the migration state only.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('core', '0002_idempotencyrecord_apitoken'),
        ('nodes', '0003_slurm'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name='slurmallocation',
                    name='token',
                    field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='core.apitoken'),
                ),
            ],
            database_operations=[],
        ),
    ]
