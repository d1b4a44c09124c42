"""The serving core: scheduler, service, telemetry, audit, model resolution; no HTTP, no MCP."""
