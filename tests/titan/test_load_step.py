"""The checkpoint TorchTitan loads, pinned to TorchTitan's own rule.

``decision.titan_load_step`` is the one place that decides which ``step-N`` folder a
job resumes from before TorchTitan builds anything (TorchTitan has no public API for
it). Hypothesis builds checkpoint folders of every shape TorchTitan's rule looks at
(names containing ``step-N`` anywhere, DCP ``.metadata``, a safetensors index, files
instead of folders, stray entries) and asks TorchTitan's ``_find_load_step`` the same
question: a TorchTitan upgrade that changes its rule fails here, not in a resume.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchtitan_zephon.titan import platform

platform.apply()  # before torchtitan is imported (CPU, no triton)

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402

from torchtitan_zephon.titan.start.decision import titan_load_step  # noqa: E402

NAMES = st.one_of(
    st.integers(0, 10**6).map(lambda n: f"step-{n}"),
    st.tuples(st.sampled_from(["", "old-", "x"]), st.integers(0, 99),
              st.sampled_from(["", ".bak", "-tmp"])).map(lambda t: f"{t[0]}step-{t[1]}{t[2]}"),
    st.sampled_from(["step-", "steps", "tb", "step_7", "STEP-3", ".hidden"]),
)  # fmt: skip
MARKERS = st.sampled_from(["none", ".metadata", "model.safetensors.index.json", "file"])


def titans_rule(folder: Path) -> int:
    """TorchTitan's CheckpointManager._find_load_step on ``folder`` (it reads nothing else
    of the manager)."""
    return CheckpointManager._find_load_step(SimpleNamespace(folder=str(folder)), str(folder))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(NAMES, MARKERS), max_size=8, unique_by=lambda e: e[0]))
def test_the_step_preflight_picks_is_the_one_torchtitan_loads(entries):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "checkpoint"
        folder.mkdir()
        for name, marker in entries:
            if marker == "file":  # a file, not a folder, named like a checkpoint
                (folder / name).write_text("x")
                continue
            (folder / name).mkdir()
            if marker != "none":
                (folder / name / marker).write_text("{}")
        assert titan_load_step(folder) == titans_rule(folder)


def test_a_missing_folder_loads_nothing(tmp_path: Path):
    assert titan_load_step(tmp_path / "absent") == titans_rule(tmp_path / "absent") == -1
