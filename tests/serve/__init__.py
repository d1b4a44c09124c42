"""Tests of the serving core: scheduler, service, telemetry."""
