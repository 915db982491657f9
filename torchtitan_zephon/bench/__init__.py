"""Benchmarks of the Zephon data path against stock TorchTitan (``zephon bench``).

One module per suite: ``loader`` (tokens/s, restore time, state size),
``step`` (training steps/s and data wait), ``resume`` (cold start to first
batch), ``scale`` (per-rank plan cost vs world size, sequence log growth),
``prepare`` (tokenization throughput vs workers), ``mixture`` (tokens/s
with 1, 10, 100 sources vs one store, plan cost at step 10 vs 10^9, state size) and
``remote`` (a store in a loopback bucket at 0 / 20 / 50 ms per request vs local disk:
tokens/s, data wait, first batch, bytes fetched per byte trained, the naive
download; ``latency_proxy`` is its proxy), ``accounting`` (the per-source
accounting's cost on the training step) and ``ft`` (replica groups under torchft: a
group's death to the next commit against a whole-job restart, the sync quorum's cost,
samples trained twice or never against TorchTitan's torchft sharding; ``ft_loop`` is
its training loop) and ``packing`` (padding and split documents against windows and
first-fit, the packed loader's labelled tokens/s, the packing index's cost) and
``corpus`` (one rank reading a virtual corpus of 10^10 documents from a loopback S3
API against a real store of 10^6: first batch, memory, disk, bytes and requests;
``virtual_corpus``, ``object_server`` and ``corpus_rank`` are its parts). Each exposes
``run(opts: dict) -> dict`` (a JSON-able result) and ``rows(result)`` (the
printed table). Beside them: ``builtin_corpus`` and ``measure`` (what the suites share), and
the parts of ``loader``: ``contenders`` (the loaders compared), ``throughput`` and
``content_checks``.

Invariant: every compared figure is measured in the same invocation, on the
same machine, side by side; ratios are computed from those measurements and
never from remembered numbers.
"""

SUITES = [
    "loader", "step", "resume", "scale", "prepare", "mixture", "remote", "accounting", "ft",
    "packing", "corpus",
]  # fmt: skip
