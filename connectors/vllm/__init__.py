"""vLLM integration: its block hash, its KV events, its KV connector.

Nothing here imports vLLM at module import time; vLLM cannot be installed in CI, and the logic
is tested on its own and driven by NexusKV's reference engine.
"""
