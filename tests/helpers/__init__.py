"""Shared test helpers: the in-process server, tiny models of each architecture, the session worker."""
