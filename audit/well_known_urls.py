from django.urls import path

from audit import apis

urlpatterns = [path(".well-known/kcaas-platform-key.json", apis.PlatformKeyApi.as_view(), name="platform-key")]
