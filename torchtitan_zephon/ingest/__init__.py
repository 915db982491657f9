"""Raw inputs -> token store: inputs, readers, units, encode, tokenized, prepare, cache.

Role: resolve input files (``inputs``) and read their documents (``readers``,
``json_readers``: text, JSONL, JSON, Parquet, Hugging Face datasets), cut them
into work units (``units``), tokenize them in order (``encode``, ``tokenizer``),
write and assemble the tokenized units of a store (``prepare`` over ``stage``, ``tokenized`` and
``assemble``, in a group of processes: ``ranks``), and build stores on first use into a
shared cache (``cache``: store values and raw inputs' entries; ``cache_folder``: the
folder and the one build under a lock; ``cache_contents``: what it holds; the builtin
corpus: ``builtin``).

Invariant: a store's bytes depend only on its inputs, tokenizer, text field and
split, never on the number of workers or ranks. Imports only ``store`` besides
itself: no ``order``, ``job``, torch.distributed or torchtitan (the gloo rank group
lives in ``cli/prepare_ranks.py``). Import the modules directly: this package
re-exports nothing, so prepare's worker processes stay light.
"""
