from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("caches", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="cache",
            name="ssd_key_sealed",
            field=models.BinaryField(blank=True, null=True),
        ),
    ]
