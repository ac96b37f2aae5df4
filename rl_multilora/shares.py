"""Fair shares of a step's rows between tenants, when their asks exceed what a step holds.

Weighted max-min fairness in prompt groups: every RUNNING tenant first gets one group (no tenant starves, whatever
the cap), then the rows left are filled by water-filling on `rows / weight`: the tenant with the fewest rows per
unit of weight gets the next group, until the cap or every ask is reached. A tenant asking for a huge
`prompts_per_step` therefore gets at most its weighted share and cannot crowd out the others. Deterministic: ties
go to the tenant listed first (submission order).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping


def fair_quotas(
    asks: Mapping[str, tuple[int, int]], weights: Mapping[str, float], max_rows: int | None
) -> dict[str, int]:
    """Groups per tenant for one step. `asks[name] = (groups asked, rows per group)`; `max_rows` None: no cap.

    >>> fair_quotas({"a": (8, 4), "b": (8, 4)}, {"a": 1, "b": 1}, max_rows=None)
    {'a': 8, 'b': 8}
    >>> fair_quotas({"big": (80, 4), "x": (8, 4), "y": (8, 4)}, {"big": 1, "x": 1, "y": 1}, max_rows=48)
    {'big': 4, 'x': 4, 'y': 4}
    >>> fair_quotas({"a": (10, 4), "b": (10, 4)}, {"a": 3, "b": 1}, max_rows=32)
    {'a': 6, 'b': 2}
    """
    if max_rows is None or sum(g * r for g, r in asks.values()) <= max_rows:
        return {name: g for name, (g, _) in asks.items()}
    quotas = {name: min(1, g) for name, (g, _) in asks.items()}  # the guaranteed group
    rows = sum(quotas[n] * asks[n][1] for n in asks)
    order = {name: i for i, name in enumerate(asks)}
    heap = [(quotas[n] * asks[n][1] / weights[n], order[n], n) for n in asks if quotas[n] < asks[n][0]]
    heapq.heapify(heap)
    while heap:
        _, i, name = heapq.heappop(heap)
        size = asks[name][1]
        if rows + size > max_rows:
            continue  # this tenant's next group does not fit; a tenant with smaller groups still may
        quotas[name] += 1
        rows += size
        if quotas[name] < asks[name][0]:
            heapq.heappush(heap, (quotas[name] * size / weights[name], i, name))
    return quotas
