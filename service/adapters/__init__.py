"""Adapters: the gateway and backend clients, and the SQL storage (docs/contributing.md)."""
