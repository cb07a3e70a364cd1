"""The canonical format's cost against per-rank frames on the same bytes: ``python -m benchmarks.canonical_cost``.

kvdi's real store worker half saves and loads the same 1 MiB blocks (8 layers x 2 x 16 tokens x 8 KV heads x
128 dims, fp32; ``nhc`` block order, vLLM's GPU default) to shared_storage folders, once with
``format=per_rank`` and once with ``format=canonical`` (``section_heads``, the third argument, KV heads per
section: 1 by default, 8 for one section a block). Rounds alternate ABBA, BAAB; printed: each side's median,
the ratio canonical / per_rank of the medians, and the lowest and highest per-round ratio. Warm page cache.
Arguments: ``[rounds] [blocks] [heads] [order]`` (order ``nhc`` or ``hnc``). The measuring lives in
:mod:`kvdi.bench.canonical` (``kvdi bench canonical`` runs both grids).
"""

from __future__ import annotations

import sys

from kvdi.bench.canonical import measure


def main(rounds: int = 6, blocks: int = 32, heads: int = 1, order: str = "nhc") -> None:
    for cost in measure(rounds, blocks, heads, order):
        print(
            f"{cost.op} (section_heads={heads}, {order}): per_rank {cost.per_rank * 1e3:.1f} ms, "
            f"canonical {cost.canonical * 1e3:.1f} ms ({blocks} x 1 MiB); canonical/per_rank {cost.ratio:.2f}x "
            f"(per round {min(cost.ratios):.2f}-{max(cost.ratios):.2f}x, {rounds} rounds)"
        )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]), *sys.argv[4:5])
