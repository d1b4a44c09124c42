"""Tests of sessions: resumed equals fresh, the snapshot store, recovery."""
