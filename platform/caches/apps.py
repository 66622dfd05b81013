from django.apps import AppConfig


class CachesConfig(AppConfig):
    name = "caches"
    default_auto_field = "django.db.models.BigAutoField"
