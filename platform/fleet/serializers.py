"""Serializers shared by several fleet views: bytes per tier, a node as staff see it, a resident-bytes entry.
Operation-specific Input/Output serializers are nested in their views (fleet.apis)."""

from rest_framework import serializers

from fleet.models import NodeState
from fleet.validators import MAX_TIER_BYTES
from tenants.fields import StrictIntegerField  # JSON integers only: "2" and 2.0 are refused, as the schema says

MAX_TOKEN_COUNT = 2**63 - 1  # a counter stored in JSON and summed in Python: only the int64 range is refused


def _bytes_field(**kwargs) -> serializers.IntegerField:
    return StrictIntegerField(min_value=0, max_value=MAX_TIER_BYTES, **kwargs)


class TierBytesSerializer(serializers.Serializer):
    """{device, dram, ssd} byte counts; as input every tier is required."""

    device = _bytes_field()
    dram = _bytes_field()
    ssd = _bytes_field()


class NodeSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    name = serializers.CharField()
    endpoint = serializers.CharField(help_text='"host:port" of the data-plane server; empty before registration')
    state = serializers.ChoiceField(choices=NodeState.choices)
    capacity = TierBytesSerializer()
    reserved = TierBytesSerializer()
    free = TierBytesSerializer(help_text="capacity - reserved per tier, never negative")
    lease_expires_at = serializers.DateTimeField(allow_null=True)
    last_heartbeat_at = serializers.DateTimeField(allow_null=True)
    registered_at = serializers.DateTimeField(allow_null=True)
    created_at = serializers.DateTimeField()


class ResidentCacheSerializer(serializers.Serializer):
    """One cache's resident bytes per tier on the reporting node, an absolute value at report time."""

    cache_id = serializers.UUIDField()
    device_bytes = _bytes_field(default=0)
    dram_bytes = _bytes_field(default=0)
    ssd_bytes = _bytes_field(default=0)
    network_bytes = _bytes_field(default=0)  # its objects in the fleet's network store (older agents omit it)
    # The engine's token counters since the cache was provisioned on this node (optional: older agents omit them).
    hit_tokens = StrictIntegerField(min_value=0, max_value=MAX_TOKEN_COUNT, required=False)
    miss_tokens = StrictIntegerField(min_value=0, max_value=MAX_TOKEN_COUNT, required=False)


class NodeDetailSerializer(NodeSerializer):
    resident = serializers.SerializerMethodField(help_text="latest resident-bytes snapshot from heartbeats")

    def get_resident(self, node) -> dict:
        return node.resident_snapshot or {}
