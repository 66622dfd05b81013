"""Billing's refusals: each an ApplicationError with a stable code, rendered in the one error shape."""

from core.errors import ApplicationError, ConflictError


class InvalidUsageReport(ApplicationError):
    """A usage report the control plane cannot take (a time too far in the node's future, ...)."""

    code = "invalid_usage_report"


class InvalidRate(ApplicationError):
    """An unknown meter, a negative price, or an effective time that is not a whole UTC hour."""

    code = "invalid_rate"


class RateExists(ConflictError):
    """A rate of this meter already takes effect at that time: rates are never edited, a later one supersedes."""

    code = "rate_exists"


class InvalidPeriod(ApplicationError):
    """A usage series or invoice period that is empty, reversed or too long."""

    code = "invalid_period"
