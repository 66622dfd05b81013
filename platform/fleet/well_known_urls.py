from django.urls import path

from fleet.well_known import PlatformCaApi

urlpatterns = [path(".well-known/kcaas-ca.pem", PlatformCaApi.as_view(), name="platform-ca")]
