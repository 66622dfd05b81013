from django.apps import AppConfig


class RoutingConfig(AppConfig):
    name = "routing"
    label = "routing"
    default_auto_field = "django.db.models.BigAutoField"
