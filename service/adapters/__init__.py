"""Adapters: the gateway and backend clients, and the SQL storage (STYLE rule 1)."""
