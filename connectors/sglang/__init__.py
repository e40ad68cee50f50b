"""SGLang integration: its page hash, its KV events (shared decoder), its HiCache storage backend.

Nothing here imports SGLang at module import time; it cannot be installed in CI.
"""
