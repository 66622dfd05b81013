"""REST API of the routing room (docs/routing.md): a tenant registers its engine instances, and asks which of them
holds the longest prefix of a prompt. Scope `caches` (a lookup, though a POST, needs only caches:read). The tenant
is the API key's (staff name it with `?tenant_id=`), never the body's: another tenant's instance id is a 404, and its
instances never appear."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from core.openapi import AUTH_ERRORS, RATE_LIMIT_HEADERS, STAFF_TENANT_ID, RejectUnknownFieldsMixin, error_responses
from core.permissions import ScopePermission
from routing import api_examples as ex
from routing import selectors, services
from tenants.fields import StrictIntegerField
from tenants.principals import request_tenant

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
MAX_LOOKUP_TOKENS = 1 << 17  # 131,072 tokens: a long context, bounded work per lookup
MAX_ENGINE_BLOCK_SIZE = 4096
MAX_TOKEN_ID = (1 << 31) - 1


class InstanceInputSerializer(RejectUnknownFieldsMixin, serializers.Serializer):
    name = serializers.RegexField(NAME_PATTERN, help_text="Unique among the tenant's instances.")
    model = serializers.CharField(max_length=256, help_text="The model as the engine serves it (OpenAI `model`).")
    block_size = StrictIntegerField(min_value=1, max_value=MAX_ENGINE_BLOCK_SIZE, help_text="The engine's KV block.")
    api_base = serializers.URLField(max_length=512, help_text="Its OpenAI-compatible server, http://host:port.")
    events_endpoint = serializers.CharField(max_length=256, help_text="Its KV event publisher, tcp://host:port.")
    replay_endpoint = serializers.CharField(
        max_length=256,
        required=False,
        allow_blank=True,
        default="",
        help_text="Its replay socket, tcp://host:port (optional: without it a gap is skipped and counted).",
    )


class InstanceOutputSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    model = serializers.CharField()
    block_size = serializers.IntegerField()
    api_base = serializers.CharField()
    events_endpoint = serializers.CharField()
    replay_endpoint = serializers.CharField()
    state = serializers.CharField(help_text="live | lost (health checks failed: its index dropped)")
    next_seq = serializers.IntegerField(help_text="The next event batch the index expects.")
    events_applied = serializers.IntegerField()
    gaps = serializers.IntegerField(help_text="Batches lost for good (no replay): the index may miss blocks.")
    last_event_at = serializers.DateTimeField(allow_null=True)
    last_healthy_at = serializers.DateTimeField(allow_null=True)
    requests_waiting = serializers.IntegerField(allow_null=True, help_text="Its queue at the last health check.")
    requests_running = serializers.IntegerField(allow_null=True)
    created_at = serializers.DateTimeField()


class LookupInputSerializer(RejectUnknownFieldsMixin, serializers.Serializer):
    model = serializers.CharField(max_length=256)
    token_ids = serializers.ListField(
        child=StrictIntegerField(min_value=0, max_value=MAX_TOKEN_ID), max_length=MAX_LOOKUP_TOKENS
    )
    lora_name = serializers.CharField(max_length=256, required=False, allow_null=True, default=None)


class InstanceHitSerializer(serializers.Serializer):
    id = serializers.UUIDField(source="instance.id")
    name = serializers.CharField(source="instance.name")
    api_base = serializers.CharField(source="instance.api_base")
    block_size = serializers.IntegerField(source="instance.block_size")
    prefix_tokens = serializers.DictField(
        child=serializers.IntegerField(),
        help_text=(
            "Per medium (GPU, CPU, STORAGE, or what the engine names), the longest prefix held in that medium or a "
            "faster one, in tokens (whole blocks)."
        ),
    )
    used_blocks = serializers.IntegerField(help_text="Blocks the instance holds in device memory.")
    requests_waiting = serializers.IntegerField(
        source="instance.requests_waiting", allow_null=True, help_text="Its queue (vLLM's gauge; null: unreported)."
    )
    requests_running = serializers.IntegerField(
        source="instance.requests_running", allow_null=True, help_text="Requests it runs (vLLM's gauge)."
    )


class CacheHitSerializer(serializers.Serializer):
    id = serializers.UUIDField(source="cache.id")
    name = serializers.CharField(source="cache.name")
    block_size = serializers.IntegerField(source="cache.block_size")
    prefix_tokens = serializers.DictField(
        child=serializers.IntegerField(),
        help_text=(
            "Per tier (GPU: the node's device pool, CPU: its DRAM, STORAGE: its SSD, NETWORK: the fleet's network "
            "store), the longest prefix held in that tier or a faster one, in tokens (whole blocks)."
        ),
    )
    used_blocks = serializers.IntegerField(help_text="Blocks the cache holds in its device pool.")


class LookupOutputSerializer(serializers.Serializer):
    model = serializers.CharField()
    num_tokens = serializers.IntegerField()
    instances = InstanceHitSerializer(many=True)
    caches = CacheHitSerializer(many=True)


class EngineListRegisterApi(APIView):
    permission_classes = [ScopePermission]
    scope_resource = "caches"

    @extend_schema(
        operation_id="engines_list",
        summary="List engine instances",
        examples=[ex.INSTANCE_LIST],
        tags=["routing"],
        parameters=[STAFF_TENANT_ID, *RATE_LIMIT_HEADERS],
        responses={200: InstanceOutputSerializer(many=True), **error_responses(*AUTH_ERRORS, 404)},
        description="The tenant's engine instances and their index state. Needs caches:read.",
    )
    def get(self, request):
        tenant = request_tenant(request, request.query_params.get("tenant_id"))
        return Response(InstanceOutputSerializer(selectors.instances_list(tenant_id=tenant.id), many=True).data)

    @extend_schema(
        operation_id="engines_register",
        summary="Register an engine instance",
        examples=[ex.REGISTER, ex.REGISTERED],
        tags=["routing"],
        request=InstanceInputSerializer,
        parameters=[STAFF_TENANT_ID, *RATE_LIMIT_HEADERS],
        responses={201: InstanceOutputSerializer, **error_responses(*AUTH_ERRORS, 404, 409)},
        description=(
            "Register an engine instance (vLLM with `--kv-events-config` publishing over ZMQ): the indexer "
            "subscribes to its events and keeps which blocks it holds. Its hosts must lie in the networks the "
            "operator allows (KCAAS_ROUTING_ENGINE_NETWORKS: 400 endpoint_not_allowed otherwise). Needs caches:write."
        ),
    )
    def post(self, request):
        tenant = request_tenant(request, request.query_params.get("tenant_id"))
        data = InstanceInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        instance = services.instance_register(tenant=tenant, **data.validated_data)
        return Response(InstanceOutputSerializer(instance).data, status=status.HTTP_201_CREATED)


class EngineDetailDeregisterApi(APIView):
    permission_classes = [ScopePermission]
    scope_resource = "caches"

    @extend_schema(
        operation_id="engines_retrieve",
        summary="Retrieve an engine instance",
        examples=[ex.INSTANCE_LIVE],
        tags=["routing"],
        parameters=[STAFF_TENANT_ID, *RATE_LIMIT_HEADERS],
        responses={200: InstanceOutputSerializer, **error_responses(*AUTH_ERRORS, 404)},
        description="One engine instance of the tenant. Needs caches:read.",
    )
    def get(self, request, instance_id):
        tenant = request_tenant(request, request.query_params.get("tenant_id"))
        return Response(
            InstanceOutputSerializer(selectors.instance_get(instance_id=instance_id, tenant_id=tenant.id)).data
        )

    @extend_schema(
        operation_id="engines_deregister",
        summary="Deregister an engine instance",
        tags=["routing"],
        request=None,
        parameters=[STAFF_TENANT_ID, *RATE_LIMIT_HEADERS],
        responses={204: None, **error_responses(*AUTH_ERRORS, 404)},
        description="Forget an engine instance and what the index holds of it. Needs caches:write.",
    )
    def delete(self, request, instance_id):
        tenant = request_tenant(request, request.query_params.get("tenant_id"))
        services.instance_deregister(instance_id=instance_id, tenant_id=tenant.id)
        return Response(status=status.HTTP_204_NO_CONTENT)


class PrefixLookupApi(APIView):
    permission_classes = [ScopePermission]
    scope_resource = "caches"
    scope_action = "read"

    @extend_schema(
        operation_id="engines_lookup",
        summary="Find where a prompt's prefix is cached",
        examples=[ex.LOOKUP, ex.LOOKUP_HITS],
        tags=["routing"],
        request=LookupInputSerializer,
        parameters=[STAFF_TENANT_ID, *RATE_LIMIT_HEADERS],
        responses={200: LookupOutputSerializer, **error_responses(*AUTH_ERRORS, 404)},
        description=(
            "For a prompt's token ids and a model: each live instance of the tenant serving that model, and each "
            "ready cache of the tenant (whatever its model: compare its fingerprint), with the longest contiguous "
            "prefix of the prompt it holds per medium (whole blocks, in tokens) and its load (blocks in device "
            "memory). Needs caches:read."
        ),
    )
    def post(self, request):
        tenant = request_tenant(request, request.query_params.get("tenant_id"))
        data = LookupInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        answer = selectors.prefix_lookup(tenant_id=tenant.id, **data.validated_data)
        body = {
            "model": data.validated_data["model"],
            "num_tokens": len(data.validated_data["token_ids"]),
            "instances": answer.instances,
            "caches": answer.caches,
        }
        return Response(LookupOutputSerializer(body).data)
