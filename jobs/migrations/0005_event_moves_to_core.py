# The audit log (Event) now belongs to core (core/migrations/0001_initial.py): jobs forgets the
# model in the migration state only; the table jobs_event and its rows stay where they are.
# After alerts' data migration, which still reads the rows as jobs.Event.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0004_launch_module'),
        ('core', '0001_initial'),
        ('alerts', '0002_encrypted_secret_scrubbed_errors'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name='Event')],
            database_operations=[],
        ),
    ]
