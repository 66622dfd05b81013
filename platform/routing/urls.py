from django.urls import path

from routing import apis

urlpatterns = [
    path("engines", apis.EngineListRegisterApi.as_view(), name="engines"),
    path("engines/lookup", apis.PrefixLookupApi.as_view(), name="engines-lookup"),
    path("engines/<uuid:instance_id>", apis.EngineDetailDeregisterApi.as_view(), name="engine"),
]
