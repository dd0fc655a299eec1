# EfficiencyTarget and PoolPrice now belong to jobs (jobs/migrations/0007_efficiencytarget_poolprice.py):
# alerts forgets them in the migration state only; the tables alerts_efficiencytarget and
# alerts_poolprice and their rows stay where they are.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('alerts', '0002_encrypted_secret_scrubbed_errors'),
        ('jobs', '0007_efficiencytarget_poolprice'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(name='EfficiencyTarget'),
                migrations.DeleteModel(name='PoolPrice'),
            ],
            database_operations=[],
        ),
    ]
