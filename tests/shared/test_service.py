"""A service's lifespan: the component is started, then what start-up left alive is
frozen out of the garbage collector's full collections."""

from __future__ import annotations

import gc

from fastapi.testclient import TestClient

from shared.service import service_app


class Component:
    """Holds what a real component's start-up creates (clients, tables)."""

    def __init__(self) -> None:
        self.started = self.stopped = False
        self.tables: list[dict[str, list[int]]] = []

    async def start(self) -> None:
        self.tables = [{"rows": [i]} for i in range(1000)]
        self.started = True

    async def stop(self) -> None:
        self.stopped = True


def test_start_up_objects_are_frozen_out_of_full_collections() -> None:
    component = Component()

    async def build() -> Component:
        return component

    gc.unfreeze()
    try:
        with TestClient(service_app("test", build)) as client:
            assert component.started
            assert client.get("/health").json() == {"status": "ok"}
            # the component's start-up objects sit in the permanent generation: a full
            # collection no longer walks them
            assert gc.get_freeze_count() >= len(component.tables)
            frozen = gc.get_freeze_count()
            garbage: list[object] = []
            garbage.append(garbage)  # a cycle made after start-up is still collected
            del garbage
            assert gc.collect() >= 1
            assert gc.get_freeze_count() == frozen
        assert component.stopped
    finally:
        gc.unfreeze()
