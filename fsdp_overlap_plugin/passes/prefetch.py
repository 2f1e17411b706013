"""How far ahead each bucket's all-gather launches: one rule for the pass and for
``fsdp-overlap check`` (which applies it to the plan's bucket sizes before any graph
exists), so the peak ``check`` prints is the one the compiled schedule keeps.

Buckets are taken in the order a graph consumes them (forward: plan order; backward:
reverse). Bucket ``k`` with depth ``d`` launches just before bucket ``k - d``'s wait, so
while bucket ``k - d`` is consumed, buckets ``k - d .. k`` are gathered: that window's
bytes must fit ``budget``. Under a budget the launch goes just after bucket ``k - d``'s
copy-out instead (``passes/bucketing.py``): launched before the wait, bucket ``k``'s
buffer would also meet bucket ``k - d``'s gathered buffer and its copies, one bucket
more than the window. ``k - d == -1`` is the top of the graph (before anything is
consumed); depth 0 means "not moved ahead". The first bucket launches at the top (if it
fits the budget).
A backward graph starts with the buckets the forward kept gathered (``kept``): at its
top they count toward the budget, and at most ``depth + 1`` buckets are gathered there.
Launch points never go backwards (bucket ``k`` is not issued before bucket ``k - 1``):
backends run one communicator's collectives in issue order.

    sizes 4 4 4 4, depth 1                  -> depths 1 1 1 1, peak 8 (two buckets)
    sizes 4 4 4 4, depth 2                  -> depths 1 2 2 2, peak 12
    sizes 4 4 4 4, depth 2, budget 10       -> depths 1 2 1 1, peak 8 (bucket 1 at the top)
    sizes 4 4 4 4, depth 1, budget 6        -> depths 1 0 0 0, peak 4
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["PrefetchPlan", "kept_buckets", "prefetch_plan"]


class PrefetchPlan(NamedTuple):
    depths: list[int]
    """Per bucket in consumption order: how many buckets ahead its all-gather launches."""
    peak_bytes: int
    """The most gathered bytes alive at a launch point (the consumed bucket included)."""
    peak_buckets: list[int]
    """The window (consumption indices) at that peak."""
    peak_at_top: bool = False
    """The peak is at the top of the graph (where ``kept`` buckets count too)."""


def prefetch_plan(
    sizes: list[int], depth: int = 1, budget: int | None = None, kept: tuple[int, int] = (0, 0)
) -> PrefetchPlan:
    """Depth per bucket for gathered ``sizes`` (bytes, consumption order) under ``depth``
    and ``budget`` (see the module doc).

    ``kept``: ``(buckets, bytes)`` already gathered when the graph starts (a backward
    graph: the buckets the forward kept gathered, computed before the first re-gathered
    one). They count at the top of the graph: there at most ``depth + 1`` buckets are
    gathered, kept ones included, and their bytes are part of the budget."""
    kept_buckets, kept_bytes = kept
    depths: list[int] = []
    peak, peak_window, peak_top = 0, [], False
    previous = -1  # launch point of the bucket before: the wait it launched before (-1: top)
    for k in range(len(sizes)):
        chosen = 0
        if k == 0:
            # the first bucket launches at the top of the graph, unless the kept buckets
            # and it do not fit the budget together (then where the graph has it: after
            # the kept buckets' compute, which frees them)
            chosen = 1 if budget is None or sizes[0] + kept_bytes <= budget else 0
        else:
            for d in range(min(depth, k + 1), 0, -1):
                point = k - d
                if point < previous:
                    continue
                window = sum(sizes[max(point, 0) : k + 1])
                if point < 0:
                    if kept_buckets + k + 1 > depth + 1:
                        continue
                    window += kept_bytes
                if budget is None or window <= budget:
                    chosen = d
                    break
        depths.append(chosen)
        previous = k - chosen
        window = list(range(max(k - chosen, 0), k + 1))
        held = sum(sizes[i] for i in window) + (kept_bytes if k - chosen < 0 else 0)
        if held > peak:
            peak, peak_window, peak_top = held, window, k - chosen < 0
    if not sizes and kept_bytes:
        peak, peak_top = kept_bytes, True
    return PrefetchPlan(depths, peak, peak_window, peak_top)


def kept_buckets(sizes: list[int], depth: int, budget: int | None, cover: bool = True) -> int:
    """How many of the last buckets (``sizes`` in forward order) the forward keeps gathered
    for backward (the reshard pass's rule, ``passes/reshard.py``): the last one always,
    then up to ``depth`` in all as long as their bytes fit ``budget``, and one more where
    those kept gather fewer bytes than the bucket before them (and it fits the budget;
    ``cover``: only where the backward prefetches, i.e. with the bucketing pass).

    The backward computes the kept buckets while its first re-gather runs, so that
    re-gather hides only if their compute is about as long as it is. Gathered bytes stand
    in for compute (a bucket of matmul weights computes in proportion to them): a small
    last bucket (a final norm and a head over a small vocabulary) before a full block
    would leave the block's re-gather exposed, so the block stays gathered too.

        sizes 1 4 4 4 1, depth 1  -> 2 (1 < 4: the last block stays as well)
        sizes 1 4 4 4 4, depth 1  -> 1
        sizes 1 4 4 4 1, depth 2  -> 2 (5 >= 4)
        sizes 1 4 4 4 1, depth 1, budget 4 -> 1
    """
    count, total = 0, 0
    for size in reversed(sizes):
        if count and budget is not None and total + size > budget:
            break
        if count >= max(depth, 1) and (not cover or count > max(depth, 1) or total >= size):
            break
        count, total = count + 1, total + size
    return count
