"""CLI test fixtures: reuse the shared tokenizer, corpus and store fixtures (tests/conftest.py)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "zephon_data_test_fixtures", Path(__file__).parent.parent / "conftest.py"
)
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)

tokenizer_dir = _fixtures.tokenizer_dir
corpus_dir = _fixtures.corpus_dir
store_path = _fixtures.store_path
store = _fixtures.store
build_tokenizer = _fixtures.build_tokenizer
copy_store = _fixtures.copy_store
edit_token = _fixtures.edit_token
make_v1 = _fixtures.make_v1
