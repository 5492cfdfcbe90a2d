"""Watching what a fake server is asked: the order of its requests and how many it held at once."""

from __future__ import annotations

from hsdump.testing import FakeServer


def count_requests(fake: FakeServer) -> tuple[list[str], list[int]]:
    """Wrap the engine of ``fake``: the rids in their order of arrival, and ``[peak]`` at once."""
    generate, order, peak, now = fake.engine.generate, [], [0], [0]

    async def counting(request):
        order.append(request.rid)
        now[0] += 1
        peak[0] = max(peak[0], now[0])
        try:
            return await generate(request)
        finally:
            now[0] -= 1

    fake.engine.generate = counting
    return order, peak
