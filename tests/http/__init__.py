"""Tests of the HTTP APIs through the official clients on a real uvicorn server."""
