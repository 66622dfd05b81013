from django.urls import path

from caches import apis

urlpatterns = [path(".well-known/jwks.json", apis.JwksApi.as_view(), name="jwks")]
