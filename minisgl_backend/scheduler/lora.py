"""Which LoRA adapter each of the engine's `max_loras` device slots holds.

Requests name adapters; an admitted request holds its adapter's slot until it ends. A request
whose adapter is not resident takes the least recently used slot that no running request holds
(the engine copies the adapter in before the step that admits it: `StepMessage.lora_load_*`);
with every slot held by other adapters it waits, first come first served.
"""

from __future__ import annotations

from minisgl_backend.lora.config import parse_lora_adapters


class AdapterSlots:
    def __init__(self, lora_adapters: str, max_loras: int) -> None:
        # Adapter ids: 1, 2, ... in the setting's order (0: the base model).
        self.ids = {name: i + 1 for i, name in enumerate(parse_lora_adapters(lora_adapters))}
        self.holds = [0] * max_loras  # adapter id per slot (0: empty)
        self.users = [0] * max_loras  # running requests per slot
        self.last_use = [0] * max_loras
        self._clock = 0

    def id_of(self, name: str | None) -> int:
        """An adapter's id (None: the base model, 0); ValueError naming an unknown one."""
        if name is None:
            return 0
        if name not in self.ids:
            known = ", ".join(self.ids) or "none are served"
            raise ValueError(f"lora: unknown adapter {name!r} (served: {known})")
        return self.ids[name]

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
