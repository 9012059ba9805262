"""Two units and a head (tests/models.py's Units) as a model file, for lint fixtures."""

from tests.models import units as build_model  # noqa: F401
