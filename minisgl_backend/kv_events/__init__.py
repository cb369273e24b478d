"""KV-cache events for routers that keep prefix caches useful across replicas (Dynamo's KV
router, llm-d's KV-cache indexer, SGLang's gateway), in vLLM's wire format (`wire`).

The radix prefix cache reports every page that enters or leaves it (`kvcache.CacheEvents`) on
the scheduler thread; the publisher (`publisher`) queues the reports there and, on its own
thread, names each page by a block hash chained over the token ids (`hashing`, `ledger`) and
sends `BlockStored`, `BlockRemoved` and `AllBlocksCleared` over a ZeroMQ PUB socket, with a
replay socket for subscribers that missed messages. One publisher per model instance, on the
scheduler side: tensor-parallel engine ranks publish nothing. A cache without it does no event
work at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from minisgl_backend.settings import EngineSettings

if TYPE_CHECKING:
    from minisgl_backend.kv_events.publisher import KvEventPublisher


def kv_event_publisher(settings: EngineSettings, device_type: str,
                       adapter_name: Callable[[int], str | None]) -> KvEventPublisher | None:
    """The publisher `settings` ask for, its sockets bound (None: events are off). `device_type`:
    where the KV pool lives ("cuda", "cpu"); `adapter_name(lora_id)`: a LoRA adapter's name.
    ValueError naming the setting whose endpoint cannot be bound."""
    if not settings.kv_events_endpoint:
        return None
    from minisgl_backend.kv_events.ledger import BlockLedger
    from minisgl_backend.kv_events.publisher import KvEventPublisher

    medium = "GPU" if device_type == "cuda" else "CPU"
    ledger = BlockLedger(settings.page_size, medium, adapter_name)
    return KvEventPublisher(settings.kv_events_endpoint,
                            settings.kv_events_replay_endpoint or None,
                            settings.kv_events_topic, ledger)


__all__ = ["kv_event_publisher"]
