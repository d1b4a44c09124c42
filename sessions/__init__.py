"""Sessions: conversations by id, KV snapshots on disk, SQLite index, prefill plan."""
