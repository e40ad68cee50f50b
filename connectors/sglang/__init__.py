"""SGLang integration: its page hash, its KV events (shared decoder), its HiCache storage backend.

Nothing here imports SGLang at module import time: the backend class is built when SGLang's
storage factory asks for it. The tests that run SGLang 0.5.23's own code with it are
``tests/connectors/sglang_real/`` (SGLang from ``infra/engines/install_sglang.sh``).
"""
