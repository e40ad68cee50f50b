"""The broker an attack script runs against: ``NEXUSKV_BROKER`` when set, else a local Apache Kafka
started for the run (and stopped after it)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from nexuskv.config import BrokerUrl, parse_broker_url

__all__ = ["attack_broker"]


@contextlib.contextmanager
def attack_broker() -> Iterator[BrokerUrl]:
    given = os.environ.get("NEXUSKV_BROKER")
    if given:
        yield parse_broker_url(given)
        return
    from streams.bus.broker import ApacheKafkaBroker

    with ApacheKafkaBroker() as broker:
        yield broker.url
