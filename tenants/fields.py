"""Strict serializer fields for request bodies: JSON types are checked, not coerced.

DRF's CharField turns 42 into "42" and IntegerField turns "42" (and 42.0) into 42; an API whose schema says
``string``/``integer`` should refuse the other type (400 with field details), so clients and fuzzers see the same
contract the schema states.
"""

from drf_spectacular.drainage import set_override
from rest_framework import serializers

from tenants.quota_values import QuotaValueError, quota_value_parse, string_pattern, takes_strings


class StrictCharField(serializers.CharField):
    default_error_messages = {"not_a_string": "A string is required."}

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("not_a_string")
        return super().to_internal_value(data)


class StrictIntegerField(serializers.IntegerField):
    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class QuotaValueField(serializers.Field):
    """A quota limit: an integer, or for byte limits a string with a unit that the one quota parser
    (tenants.quota_values) reads, e.g. "1GiB"."""

    def __init__(self, *, quota_field: str, bounds: tuple[int, int], **kwargs):
        self.quota_field, self.bounds = quota_field, bounds
        super().__init__(**kwargs)
        low, high = bounds
        integer = {"type": "integer", "minimum": low, "maximum": high}
        if takes_strings(quota_field):
            set_override(
                self, "field", {"oneOf": [integer, {"type": "string", "pattern": string_pattern(quota_field, bounds)}]}
            )
        else:
            set_override(self, "field", integer)

    def to_internal_value(self, data):
        try:
            return quota_value_parse(self.quota_field, data, bounds=self.bounds)
        except QuotaValueError as error:
            raise serializers.ValidationError(str(error)) from error

    def to_representation(self, value):
        return value


class StrictBooleanField(serializers.BooleanField):
    """true or false only: DRF's BooleanField also takes "yes", "1", 1 and "on"."""

    default_error_messages = {"not_a_boolean": "Must be true or false."}

    def to_internal_value(self, data):
        if not isinstance(data, bool):
            self.fail("not_a_boolean")
        return data
