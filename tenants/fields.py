"""Strict serializer fields for request bodies: JSON types are checked, not coerced.

DRF's CharField turns 42 into "42" and IntegerField turns "42" (and 42.0) into 42; an API whose schema says
``string``/``integer`` should refuse the other type (400 with field details), so clients and fuzzers see the same
contract the schema states.
"""

from rest_framework import serializers


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
