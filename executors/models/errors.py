"""The one error of model loading: a model directory or config this decoder cannot serve."""

from __future__ import annotations


class UnsupportedModel(ValueError):
    """A model directory or config this decoder cannot serve."""
