"""Bitwise-reproducible training (``zephon.reproducible``, DESIGN guarantee 9): the
same parameters, optimizer state and logged losses at any DP degree (issue 46).

- ``fixed_point``: the exact, order-free sum of floating-point values (limbs of a
  fixed grid in int64);
- ``gradients``: a step's gradients, summed exactly over its micro-batches and
  its data-parallel ranks (FSDP's reduce-scatter, or a rank's own gradients at DP
  1), the exact gradient norm that clipping uses, and the exact step loss;
- ``step``: the training step that uses them in place of TorchTitan's.

This package re-exports nothing: import the modules.
"""
