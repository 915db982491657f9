"""Zephon data engine: token store, permutation, plan and loader.

Pure Python + numpy + torch tensors. No torch.distributed, no torchtitan imports.
"""
