"""Wire contracts of every NexusKV topic (DESIGN.md, "Topics"), versioned and validated.

One module per topic payload; :mod:`nexuskv.contracts.topics` binds them to topic names and
encodings; :mod:`nexuskv.contracts.codec` turns them into bytes and back.
"""

from nexuskv.contracts.codec import decode, encode
from nexuskv.contracts.topics import TOPICS, Topic, topic_named

__all__ = ["TOPICS", "Topic", "decode", "encode", "topic_named"]
