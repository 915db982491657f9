"""The token-weighted reduction across replica groups (issue 30 part a2), with real
parts: a real ``torchft_lighthouse`` on loopback and real torchft Managers, one per
replica group, each in its own process on its own TCPStore, over gloo.

Each group joins a synchronous quorum, trains its part of one fixed step (the cut of
``order.layout.part_slice``), and the groups reduce once. The committed gradient must
be the gradient of the mean loss over the whole step, and the reduced loss the whole
step's mean loss: also when the parts are unequal (three groups at a global batch of 8
train 3, 3 and 2 samples), where torchft's average over groups would be wrong.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.titan.conftest import lighthouse_at
from tests.titan.ft_worker import TOKENS, loss_sum, model_and_step

REPO = Path(__file__).resolve().parents[2]


def _run_groups(n: int, gbs: int, tmp: Path, ids: list[int] | None = None) -> list[dict]:
    ids = list(range(n)) if ids is None else ids  # each group's replica id
    with lighthouse_at(n) as url:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.titan.ft_worker",
                    str(ids[r]),
                    str(n),
                    url,
                    str(gbs),
                    str(tmp / f"group{r}.pt"),
                ],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            for r in range(n)
        ]
        outs = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
            outs.append(out)
            assert p.returncode == 0, out[-3000:]
    return [torch.load(tmp / f"group{r}.pt") for r in range(n)]


@pytest.mark.parametrize("n, gbs", [(3, 8), (2, 8)])
def test_groups_reduce_to_the_whole_steps_mean_gradient_and_loss(tmp_path, n, gbs):
    results = _run_groups(n, gbs, tmp_path)
    assert sorted(r["part"] for r in results) == list(range(n))
    assert {r["parts"] for r in results} == {n} and all(r["commit"] for r in results)
    assert sum(r["count"] for r in results) == gbs
    # every group knows who trains which part (the log's quorum event: issue 43 case 10)
    members = [r for r, _ in sorted(enumerate(results), key=lambda t: t[1]["part"])]
    assert all(res["members"] == members for res in results), [res["members"] for res in results]
    model, x, y = model_and_step(gbs)  # one group, the whole step, no torchft
    whole = loss_sum(model, x, y) / (gbs * TOKENS)
    whole.backward()
    want = [p.grad for p in model.parameters()]
    for r in results:  # every group commits the same update: the whole step's gradient
        assert r["loss"] == pytest.approx(float(whole.detach()), rel=1e-5)
        for got, ref in zip(r["grads"], want, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
    if len({r["count"] for r in results}) > 1:  # unequal parts: a mean of the groups'
        means = []  # own means (torchft's AVG) is not the step's gradient
        for r in sorted(results, key=lambda r: r["part"]):
            m, _, _ = model_and_step(gbs)
            first = sum(q["count"] for q in results if q["part"] < r["part"])
            sl = slice(first, first + r["count"])
            (loss_sum(m, x[sl], y[sl]) / (r["count"] * TOKENS)).backward()
            means.append([p.grad for p in m.parameters()])
        avg = [sum(gs) / n for gs in zip(*means, strict=True)]
        assert not all(torch.allclose(a, b, rtol=1e-5) for a, b in zip(avg, want, strict=True))


def test_two_groups_with_one_replica_id_are_each_stopped(tmp_path):
    """torchft accepts two groups with one replica id (it appends a uuid to each): Zephon
    finds them at the quorum and stops both, naming the id."""
    results = _run_groups(2, 8, tmp_path, ids=[0, 0])
    for r in results:
        assert r["shared"] == (
            "2 replica groups in this quorum run with --fault_tolerance.replica_id 0: each "
            "group needs its own id in [0, 2). Restart this group with a free id; its run "
            "folder is kept."
        )
