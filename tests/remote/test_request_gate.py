"""The slots of a store's range requests (store/object_client.py ``RequestGate``): never more
holders than slots, a freed slot goes to the oldest urgent waiter (else the oldest
other one), a cancelled waiter leaves no trace and no slot stays free while a request
waits. Hypothesis drives random acquires, releases and cancels (one right after its slot was handed over)
against a plain model."""

from __future__ import annotations

import asyncio
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_zephon.store.object_client import RequestGate

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("acquire"), st.booleans()),
        st.tuples(st.just("release"), st.integers(0, 50)),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
        st.tuples(st.just("release, cancel the next"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=80, deadline=None)
@given(size=st.integers(1, 4), ops=OPS)
def test_the_gate_matches_its_model(size: int, ops: list[tuple[str, object]]) -> None:
    async def run() -> None:
        gate = RequestGate(size)
        tasks: list[asyncio.Task] = []
        holding: list[int] = []  # request numbers holding a slot, as the model says
        waiting: tuple[deque[int], deque[int]] = (deque(), deque())  # urgent, other
        free = size

        async def settle() -> None:
            for _ in range(5):
                await asyncio.sleep(0)

        def give() -> None:
            nonlocal free
            for queue in waiting:
                if queue:
                    holding.append(queue.popleft())
                    return
            free += 1

        for op, arg in ops:
            if op == "acquire":
                tasks.append(asyncio.ensure_future(gate.acquire(bool(arg))))
                k = len(tasks) - 1
                if free and not any(waiting):
                    free -= 1
                    holding.append(k)
                else:
                    waiting[0 if arg else 1].append(k)
            elif op == "release" and holding:
                k = holding.pop(int(arg) % len(holding))
                gate.release()
                give()
            elif op == "release, cancel the next" and holding and any(waiting):
                holding.pop(int(arg) % len(holding))
                gate.release()  # hands the slot to a waiter, cancelled before it resumes
                give()
                k = holding.pop()
                tasks[k].cancel()
                give()  # it hands the slot on
            elif op == "cancel" and any(waiting):
                queued = [*waiting[0], *waiting[1]]
                k = queued[int(arg) % len(queued)]
                tasks[k].cancel()
                for queue in waiting:
                    if k in queue:
                        queue.remove(k)
            await settle()
            got = [
                k for k, t in enumerate(tasks) if t.done() and not t.cancelled() and k in holding
            ]
            held = [k for k, t in enumerate(tasks) if t.done() and not t.cancelled()]
            assert sorted(got) == sorted(holding)  # every holder of the model has its slot
            assert len(holding) <= size and free + len(holding) == size
            assert not (free and any(waiting))  # no slot left free while a request waits
            assert gate.free == free
            # the others still wait (or were cancelled, or released: then in neither)
            for k in (*waiting[0], *waiting[1]):
                assert not tasks[k].done()
            assert set(holding) <= set(held)

    asyncio.run(run())
