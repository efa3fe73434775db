"""runtime.http_worker.disconnect: watches without a server: armed only after WATCH_AFTER_S, by one
task for all requests; a client gone (http.disconnect, or a receive() that refuses) calls its
request's abort; a watch closed first is never armed; one failing watch spoils none other."""

from __future__ import annotations

import asyncio

from runtime.http_worker.disconnect import DisconnectWatches


def test_watches_are_armed_after_their_wait_and_report_clients_gone():
    async def scenario() -> None:
        watches = DisconnectWatches()
        watches.WATCH_AFTER_S = 0.2
        gone: list[str] = []
        received = asyncio.Event()

        async def disconnect() -> dict:
            received.set()
            return {"type": "http.disconnect"}

        async def silent() -> dict:  # the client stays: receive() never returns
            await asyncio.Event().wait()

        def refusing():
            raise RuntimeError("the connection is closed")

        def failing_abort() -> None:
            raise ValueError("a bug in an abort")

        watches.watch(refusing, failing_abort)  # raises inside run(): logged, the rest still armed
        watches.watch(refusing, lambda: gone.append("refused"))
        watches.watch(disconnect, failing_abort)
        watches.watch(disconnect, lambda: gone.append("left"))
        staying = watches.watch(silent, lambda: gone.append("stayed?"))
        watches.watch(disconnect, lambda: gone.append("closed first")).close()
        task = asyncio.create_task(watches.run())
        await asyncio.sleep(0.05)
        assert gone == [] and not received.is_set() and len(watches.unarmed) == 5  # not armed yet
        await asyncio.sleep(0.5)
        assert sorted(gone) == ["left", "refused"] and not watches.unarmed and not task.done()
        staying.close()  # cancels its pending receive()
        task.cancel()

    asyncio.run(scenario())
