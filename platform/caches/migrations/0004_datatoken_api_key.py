import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("caches", "0003_migration"),
        ("tenants", "0002_tenantkey"),
    ]

    operations = [
        migrations.AddField(
            model_name="datatoken",
            name="api_key",
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL,
                                    related_name="+", to="tenants.apikey"),
        ),
    ]
