"""Imported last by the ranks' fork server (``_dist.PRELOAD``): moves every object the
preloaded imports made (torch, transformers, Lightning: about 400,000 tracked by the
garbage collector) to the permanent generation, where the collector never scans them again.

Each forked rank inherits that. Without it every full collection in a rank walks all of
them again while the rank compiles (1.7 s of a tiny Llama's 50 s cold inductor compile,
measured with ``gc.callbacks``), and the walk writes to their headers, so the pages the
rank shares with the server are copied into each rank as well. Python's documentation
recommends ``gc.freeze()`` before ``fork`` for both reasons.

The fork server ignores an ``ImportError`` in a preloaded module: tests/repo/
test_dist_harness.py checks that a rank starts with the objects frozen."""

import gc

gc.freeze()
