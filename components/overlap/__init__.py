"""The AR and DiT steps of a shard at once on one engine (run.py)."""
