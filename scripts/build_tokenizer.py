"""Rebuild the tokenizer shipped in torchtitan_zephon/assets/tokenizer/.

A byte-level BPE with 2,048 entries (the vocabulary of TorchTitan's llama3
debug flavors), trained on the documentation topics that ship with CPython
(`pydoc_data.topics`). The result is committed; this script documents how it
was made: `python scripts/build_tokenizer.py torchtitan_zephon/assets/tokenizer`.
"""

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def main(out: str) -> None:
    import pydoc_data.topics

    texts = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": False, "add_eos_token": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {path} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "torchtitan_zephon/assets/tokenizer")
