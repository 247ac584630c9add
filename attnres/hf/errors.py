"""The error every conversion raises: a feature the target cannot express, or an inconsistent request."""

from __future__ import annotations


class ConversionError(ValueError):
    """The source model uses something the target does not have (or the request is inconsistent)."""
