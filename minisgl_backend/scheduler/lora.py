"""The LoRA adapters the scheduler knows, and which one each of the engine's `max_loras` device
slots holds.

Requests name adapters; an admitted request holds its adapter's slot until it ends. A request
whose adapter is not resident takes the least recently used slot that no running request holds:
the step that admits it tells the engine to copy the adapter in first (and, for an adapter
loaded at run time, to read it from its folder the first time). With every slot held by other
adapters it waits, first come first served. Adapters are registered by name at startup
(`lora_adapters`) or at run time (`LLM.load_lora`); an id is never reused, so a slot never holds
an unloaded adapter under another's id.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

from minisgl_backend.core import Req
from minisgl_backend.engine.protocol import StepMessage
from minisgl_backend.lora.config import parse_lora_adapters


class AdapterSlots:
    def __init__(self, lora_adapters: str, max_loras: int, max_cpu_loras: int = 0) -> None:
        """`max_cpu_loras`: host copies the engine keeps (0: no limit)."""
        self._lock = threading.Lock()  # names are registered from callers' threads
        self.ids: dict[str, int] = {}  # name -> id (1, 2, ...; 0: the base model)
        self.names: dict[int, str] = {}  # id -> name, unloaded adapters' too
        self.folders: dict[int, Path] = {}
        self._next_id = 1
        for name, folder in parse_lora_adapters(lora_adapters).items():
            self._add(name, folder)
        # Host copies on the engine, least recently loaded first (it reads the startup
        # adapters itself).
        self.engine_has: dict[int, None] = dict.fromkeys(self.folders)
        self.max_cpu_loras = max_cpu_loras
        self.holds = [0] * max_loras  # adapter id per slot (0: empty)
        self.users = [0] * max_loras  # running requests per slot
        self.last_use = [0] * max_loras
        self._clock = 0

    def _add(self, name: str, folder: Path) -> int:
        adapter_id, self._next_id = self._next_id, self._next_id + 1
        self.ids[name], self.folders[adapter_id] = adapter_id, Path(folder)
        self.names[adapter_id] = name
        return adapter_id

    def register(self, name: str, folder: Path) -> int:
        with self._lock:
            if name in self.ids:
                raise ValueError(f"lora: adapter {name!r} is already loaded")
            return self._add(name, folder)

    def unregister(self, name: str) -> None:
        """New requests can no longer name it; those already queued still run under it."""
        with self._lock:
            if self.ids.pop(name, None) is None:
                raise ValueError(f"lora: unknown adapter {name!r}")

    def id_of(self, name: str | None) -> int:
        """An adapter's id (None: the base model, 0); ValueError naming an unknown one."""
        if name is None:
            return 0
        with self._lock:
            if name in self.ids:
                return self.ids[name]
            known = ", ".join(self.ids) or "none are loaded"
        raise ValueError(f"lora: unknown adapter {name!r} (loaded: {known})")

    def _slot_for(self, adapter_id: int) -> int | None:
        if adapter_id in self.holds:
            return self.holds.index(adapter_id)
        free = [s for s, users in enumerate(self.users) if users == 0]
        return min(free, key=lambda s: self.last_use[s]) if free else None

    def can_acquire(self, adapter_id: int) -> bool:
        return self._slot_for(adapter_id) is not None

    def acquire(self, adapter_id: int) -> tuple[int, bool]:
        """(the adapter's slot, whether the engine must load it there first)."""
        slot = self._slot_for(adapter_id)
        assert slot is not None, "acquire only after can_acquire"
        load = self.holds[slot] != adapter_id
        self.holds[slot] = adapter_id
        self.users[slot] += 1
        self._clock += 1
        self.last_use[slot] = self._clock
        return slot, load

    def release(self, slot: int) -> None:
        self.users[slot] -= 1

    def _drop_host_copies(self, msg: StepMessage) -> None:
        """Free the least recently loaded host copies beyond `max_cpu_loras` (never one a slot
        holds: the engine may reload a slot from it no more, but keeping it costs nothing)."""
        while self.max_cpu_loras and len(self.engine_has) > self.max_cpu_loras:
            victim = next((a for a in self.engine_has if a not in self.holds), None)
            if victim is None:
                return
            del self.engine_has[victim]
            msg.lora_drop_ids.append(victim)

    def stats(self, running: Iterable[Req], waiting: Iterable[Req]) -> dict[str, Any]:
        """`SchedulerStats`' LoRA fields: requests per adapter name, and the resident ones."""
        def per_adapter(reqs: Iterable[Req]) -> tuple[tuple[str, int], ...]:
            counts = Counter(self.names[r.lora_id] for r in reqs if r.lora_id)
            return tuple(sorted(counts.items()))

        return {"lora_running": per_adapter(running), "lora_waiting": per_adapter(waiting),
                "lora_resident": tuple(sorted(self.names[a] for a in self.holds if a))}

    def admit(self, msg: StepMessage, req: Req) -> None:
        """What the engine needs of an admitted request's adapter, if it has one."""
        if req.lora_slot < 0:
            return
        if req.lora_load:  # copied into its slot before the step runs
            if req.lora_id not in self.engine_has:
                path = str(self.folders[req.lora_id]).encode()
                msg.lora_read_ids.append(req.lora_id)
                msg.lora_read_paths.extend(path)
                msg.lora_read_path_lens.append(len(path))
            self.engine_has.pop(req.lora_id, None)
            self.engine_has[req.lora_id] = None  # most recently loaded
            self._drop_host_copies(msg)
            msg.lora_load_slots.append(req.lora_slot)
            msg.lora_load_ids.append(req.lora_id)
            req.lora_load = False
        msg.lora_rows.append(req.table_idx)
        msg.lora_slots.append(req.lora_slot)
