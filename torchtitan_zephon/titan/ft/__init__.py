"""torchft on Zephon's side: replica groups that join and leave a running job, each step
training exactly its global batch (issue 30). ``settings``: the ``--fault_tolerance.*``
settings checked at start, and the lighthouse's address; ``quorum``: torchft's Manager
with a synchronous quorum, and the one token-weighted reduction across groups per step;
``step``: a training step under torchft; ``heal``: what a returning group takes from its
peers (weights, optimizer, data state, the log records it missed)."""
