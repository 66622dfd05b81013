from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("caches", "0004_datatoken_api_key"),
    ]

    operations = [
        migrations.AddField(
            model_name="cache",
            name="emptied_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
