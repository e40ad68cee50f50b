"""The composition root: the one place that wires NexusKV's services and engines together.

* :mod:`streams.app.cli` — the ``nexuskv`` command;
* :mod:`streams.app.services` — the service registry ``nexuskv up`` starts;
* :mod:`streams.app.replay` — ``nexuskv replay``: a trace through engines and every service;
* :mod:`streams.app.traces` — Mooncake FAST'25 request traces, read into frozen values;
* :mod:`streams.app.tiny_model` — a tiny random Llama in a folder, for starting real engines (vLLM)
  where no model hub is reachable (the real-vLLM tests build one).

Nothing below this package imports it. Engine adapters (``connectors``) sit above ``streams`` in
the dependency order, so this package starts them as processes by module name
(``python -m streams.bridge``), never by import.
"""
