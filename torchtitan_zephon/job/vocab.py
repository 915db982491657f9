"""The vocabulary guard of a job's stores: token ids the model cannot embed.

Role: ``store_id_limit(store, vocab_size)`` refuses a store whose recorded largest
token id the model cannot embed and returns the limit a loader must still check per
batch (only for stores that record no ``max_token_id``); ``store_out_of_vocab`` is
the message for a batch that holds an id at or above that limit.

Invariant: no id at or above the model's vocabulary reaches the model: a store is
refused at start from its recorded maximum, or each batch of a store without one is
checked (``job.loader``) and refused with this message.
"""

from __future__ import annotations

import numpy as np

from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.reader import TokenStore


def store_id_limit(store: TokenStore, vocab_size: int | None) -> int | None:
    """Refuse a store whose recorded ids exceed ``vocab_size``; the limit left to check per
    batch (only for stores that record no max_token_id)."""
    if vocab_size is None:
        return None
    if store.max_token_id is None:
        return int(vocab_size)
    if store.max_token_id >= vocab_size:
        raise StoreError(
            f"the store {str(store.path)!r} holds token ids up to {store.max_token_id}, but the "
            f"model embeds only {vocab_size} ids (0..{vocab_size - 1}): use a model whose "
            f"vocab_size is at least {store.max_token_id + 1}, or a store prepared with the "
            "model's tokenizer."
        )
    return None


def store_out_of_vocab(
    store: TokenStore,
    ids: np.ndarray,
    tokens: np.ndarray,
    seq_len: int,
    limit: int,
    *,
    packed: bool = False,
) -> str:
    """Where the largest id of ``tokens`` (rows of samples ``ids``) is, and what to do;
    ``packed``: the ids are packed sample ids (``job.packed``), named as such."""
    row, col = np.unravel_index(int(np.argmax(tokens)), tokens.shape)
    sample = int(np.asarray(ids).ravel()[row])
    at = (
        f"input {int(col)} of packed sample {sample}"
        if packed
        else f"token {sample * seq_len + int(col)} (sample {sample})"
    )
    return (
        f"the store {str(store.path)!r} holds token id {int(tokens[row, col])} at {at}, "
        f"outside the model's vocabulary of "
        f"{limit} ids. The store has no content checksums (format {store.version}), so this may "
        f"be a changed file: check it with `zephon inspect {store.path} --check`, or rebuild it "
        "with `zephon prepare`."
    )
