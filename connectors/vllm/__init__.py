"""vLLM integration: its block hash, its KV connector (two sides, vLLM's shell), its tiers' publisher.

Importing this package, or :mod:`connectors.vllm.connector`, does not import vLLM: only
:mod:`connectors.vllm.shell` does, when vLLM asks for ``NexusKVConnector``. Real-vLLM tests:
``tests/engines/vllm/`` (install vLLM with ``bash infra/engines/install_vllm.sh``).
"""
