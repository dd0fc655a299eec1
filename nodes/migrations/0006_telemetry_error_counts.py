"""Raw samples and rollups hold the errors counted since the sample before, not lifetime totals.

Lifetime counts (an agent's Xids since it started, a link's CRC errors since boot) are nonzero on
many healthy GPUs for good, so the arrays were rarely NULL; the rises are, and cost nothing then.
Renamed in place (``ALTER TABLE … RENAME COLUMN`` reaches every partition).
"""

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("nodes", "0005_telemetry_partitions_and_rollups"),
    ]

    operations = [
        migrations.RenameField(model_name=model, old_name=old, new_name=new)
        for model in ("nodegpusample", "nodegpuminute")
        for old, new in (("xid_total", "xid_errors"), ("ecc_uncorrected", "ecc_uncorrected_errors"))
    ]
