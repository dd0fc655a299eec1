# ApiToken and IdempotencyRecord now belong to core (core/migrations/0002): controlplane forgets them in
# the migration state only; the tables controlplane_apitoken and controlplane_idempotencyrecord stay.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('controlplane', '0002_apitoken_job_scope'),
        ('core', '0002_idempotencyrecord_apitoken'),
        ('nodes', '0004_alter_slurmallocation_token'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(name='IdempotencyRecord'),
                migrations.DeleteModel(name='ApiToken'),
            ],
            database_operations=[],
        ),
    ]
