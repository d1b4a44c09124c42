"""Faults and properties: kill -9, full disks, read-only homes, hypothesis-driven bad input."""
