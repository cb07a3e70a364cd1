"""Helpers shared by kvdi's tests, imported as a package (``from tests.helpers.store import ...``)."""
