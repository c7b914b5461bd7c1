"""inbound.ByteBudget: bytes reserved across connections, bounded, first come first served."""

from __future__ import annotations

import asyncio

import pytest

from traceml_daemon.net.inbound import ByteBudget


def test_holds_wait_for_bytes_and_are_served_in_arrival_order() -> None:
    async def go() -> list[str]:
        budget = ByteBudget(100)
        order: list[str] = []
        first = asyncio.Event()

        async def holder(name: str, nbytes: int, until: asyncio.Event | None = None) -> None:
            async with budget.hold(nbytes):
                order.append(name)
                assert budget.bytes_held <= budget.max_bytes
                if until is not None:
                    await until.wait()

        a = asyncio.create_task(holder("a", 80, first))
        await asyncio.sleep(0)
        big = asyncio.create_task(holder("big", 60))  # must wait for a
        await asyncio.sleep(0)
        small = asyncio.create_task(holder("small", 10))  # fits now, but queues behind big
        await asyncio.sleep(0.01)
        assert order == ["a"] and budget.bytes_held == 80 and budget.statistics()["waiters"] == 2
        first.set()
        await asyncio.gather(a, big, small)
        assert budget.bytes_held == 0 and budget.peak_bytes <= 100 and budget.waits == 2
        return order

    assert asyncio.run(go()) == ["a", "big", "small"]


def test_one_request_over_the_whole_budget_passes_alone() -> None:
    async def go() -> None:
        budget = ByteBudget(100)
        got_small = asyncio.Event()

        async def small() -> None:
            async with budget.hold(1):
                assert budget.bytes_held == 1
                got_small.set()

        async with budget.hold(500):
            assert budget.bytes_held == 500
            waiting = asyncio.create_task(small())
            await asyncio.sleep(0.01)
            assert not got_small.is_set()  # nothing else while the oversize one is held
        await asyncio.wait_for(waiting, 1)
        assert got_small.is_set() and budget.bytes_held == 0

    asyncio.run(go())


def test_a_cancelled_waiter_gives_its_place_and_bytes_back() -> None:
    async def go() -> None:
        budget = ByteBudget(100)
        gate = asyncio.Event()

        async def hold(nbytes: int, until: asyncio.Event | None = None) -> None:
            async with budget.hold(nbytes):
                if until is not None:
                    await until.wait()

        blocker = asyncio.create_task(hold(90, gate))
        await asyncio.sleep(0)
        head = asyncio.create_task(hold(50))  # waits behind the blocker
        await asyncio.sleep(0)
        behind = asyncio.create_task(hold(5))  # fits, but queued behind head
        await asyncio.sleep(0.01)
        assert not behind.done()
        head.cancel()
        with pytest.raises(asyncio.CancelledError):
            await head
        await asyncio.wait_for(behind, 1)  # head gone: the small one goes through
        gate.set()
        await blocker
        assert budget.bytes_held == 0 and budget.statistics()["waiters"] == 0

    asyncio.run(go())


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ByteBudget(0)
