"""Connector contract and kvdi's built-in connectors (imported lazily by the registry)."""
