"""The one way NexusKV builds a Faust app.

Every Faust app of the project comes from :func:`make_faust_app`, so that each one gets the
start-up and rebalance settings of :data:`streams.bus.tuning.FAUST` (measured in
``benchmarks/README.md``, ``faust_time_to_first_event``) and none of Faust's defaults that cost
half a minute per start. Build the app inside a function (a service's ``main``, a test fixture),
never at module level: an App binds to an event loop and reads configuration when finalized.

Run it with ``faust.Worker(app, loglevel="INFO").execute_from_commandline()`` in its own process,
or start it as a service inside a running loop (``await app.start()``) in tests.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import faust

from nexuskv.config import BrokerUrl
from streams.bus import tuning

__all__ = ["make_faust_app", "faust_broker"]


def faust_broker(url: BrokerUrl) -> list[str]:
    """Faust's form of a bootstrap URL: one ``kafka://host:port`` per bootstrap server."""
    return [f"kafka://{host}:{port}" for host, port in url.hosts]


def make_faust_app(name: str, url: BrokerUrl, *, data_dir: Path | None = None, web_port: int | None = None,
                   **overrides: Any) -> faust.App:
    """A Faust app named ``name`` (its consumer group id) on ``url``, tuned by ``tuning.FAUST``.

    * store ``memory://`` and topic values as raw bytes (NexusKV decodes its own contracts with
      :mod:`nexuskv.contracts.codec`), unless overridden. Tables are not affected: Faust encodes
      table keys and values as JSON unless they are typed with a ``faust.Record``, so keep them
      ``str``/numbers/Records (with bytes, recovery could not decode the changelog and stalled);
    * the web server is off unless ``web_port`` is given (tests and several workers on one
      machine would otherwise fight over port 6066); it then listens on loopback only, unless
      ``web_bind`` is overridden;
    * no autodiscovery: agents are registered by the code that builds the app;
    * ``data_dir`` is Faust's ``datadir`` (it creates it even with the memory store); by default a
      folder named after the app under the system temporary folder, so nothing lands in the
      working directory. Give each worker its own ``data_dir`` when tables use ``rocksdb://``.

    ``overrides`` are any other :class:`faust.Settings` keyword and win over everything above.
    """
    settings: dict[str, Any] = dict(tuning.FAUST)
    settings.update(
        store="memory://",
        value_serializer="raw",
        autodiscover=False,
        datadir=str(data_dir if data_dir is not None else Path(tempfile.gettempdir()) / f"nexuskv-faust-{name}"),
    )
    if web_port is not None:
        settings.update(web_enabled=True, web_port=int(web_port), web_bind="127.0.0.1")
    settings.update(overrides)
    return faust.App(name, broker=faust_broker(url), **settings)
