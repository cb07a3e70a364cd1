"""Test support for kvdi users: isolated containers, overrides and recording connectors."""
