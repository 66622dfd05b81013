"""Strict, bounded limit/offset pagination.

DRF's LimitOffsetPagination passes any offset (and, without max_limit, any limit) to the database, where an offset
past PostgreSQL's bigint range is a 500, and it silently ignores malformed values. Here ``limit`` must be an integer
in [1, MAX_LIMIT] and ``offset`` in [0, MAX_OFFSET], given at most once; anything else is a 400 ``validation_error``
naming the parameter, and the schema publishes the same bounds.
"""

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination

MAX_LIMIT = 500
MAX_OFFSET = 10**12


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    max_limit = MAX_LIMIT

    def get_limit(self, request) -> int:
        return self._integer(request, self.limit_query_param, 1, MAX_LIMIT, self.default_limit)

    def get_offset(self, request) -> int:
        return self._integer(request, self.offset_query_param, 0, MAX_OFFSET, 0)

    @staticmethod
    def _integer(request, name: str, low: int, high: int, default: int) -> int:
        values = request.query_params.getlist(name)
        if not values:
            return default
        text = values[0].strip()
        if len(values) > 1 or not text.isdecimal() or len(text) > 20 or not low <= int(text) <= high:
            raise ValidationError({name: [f"An integer from {low} to {high}, given once."]})
        return int(text)

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        bounds = {self.limit_query_param: (1, MAX_LIMIT), self.offset_query_param: (0, MAX_OFFSET)}
        for parameter in parameters:
            low, high = bounds[parameter["name"]]
            parameter["schema"].update(minimum=low, maximum=high)
        return parameters
