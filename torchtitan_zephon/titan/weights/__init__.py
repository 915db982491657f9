"""Initial weights that depend on the seed and the model config only, never on the
topology (TorchTitan's model-init seam; DESIGN guarantee 5).

- ``init``: the topology-free initialisation of a model's parameters and buffers;
- ``init_draw``: the random draws, keyed per parameter;
- ``init_coverage``: that every parameter and buffer was initialised.

This package re-exports nothing: import the modules.
"""
