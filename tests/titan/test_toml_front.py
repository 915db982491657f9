"""The TOML front end of ``torchtitan_zephon.train`` (no ``--module`` / ``--config``):
a 0.2.2 TOML file and ``--section.key`` overrides become the 0.3 ``ZephonTrainer.Config``
of the job ``model.name`` / ``model.flavor`` select; the repository's TOML twins
give the registry's jobs; what cannot be carried is refused before anything runs."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

pytest.importorskip("torchtitan.config.configurable", reason="needs TorchTitan 0.3")

from torchtitan_zephon.configs import config_registry as configs  # noqa: E402
from torchtitan_zephon.configs.toml_front import TomlConfigError  # noqa: E402
from torchtitan_zephon.titan import platform  # noqa: E402
from torchtitan_zephon.train import parse_toml, toml_front_end  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "titan" / "tiny.toml"


def _same_job(a: object, b: object) -> list[str]:
    """The fields where two configs differ (initialiser closures compared by name)."""
    differ = []
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "model_spec":
            x, y = (re.sub(r" at 0x[0-9a-f]+", "", repr(v)) for v in (x, y))
        if x != y:
            differ.append(f.name)
    return differ


@pytest.mark.parametrize(
    ("toml", "function"),
    [("tests/titan/tiny.toml", "llama3_tiny"), ("train_configs/debug_model.toml", "llama3_debug")],
)
def test_a_toml_twin_is_its_registry_job(monkeypatch, toml, function):
    """Defaults + the TOML's keys == the registry function (the tokenizer path aside:
    the TOML's is relative, TorchTitan's rule, taken from the working directory)."""
    monkeypatch.chdir(ROOT)
    platform.apply()
    config = parse_toml(["--job.config_file", toml])
    job = getattr(configs, function)()
    platform.cpu_config_defaults(job)
    assert type(config) is type(job)
    assert _same_job(config, job) == ["hf_assets_path"]
    assert Path(config.hf_assets_path).resolve() == Path(job.hf_assets_path).resolve()


def test_overrides_win_in_either_spelling(monkeypatch):
    monkeypatch.chdir(ROOT)
    platform.apply()
    config = parse_toml(
        ["--job.config_file", str(TINY), "--training.steps", "3", "--validation.no-enable",
         "--validation.local_batch_size", "1", "--dump_folder", "/tmp/x", "--model.flavor", "small",
         "--zephon.seed", "5"]
    )  # fmt: skip
    assert config.training.steps == 3
    assert config.validator.enable is False and config.validator.microbatch_size == 1
    assert config.dump_folder == "/tmp/x"
    assert config.model_spec.flavor == "small" and config.model_spec.model.dim == 128
    assert config.zephon.seed == 5
    assert config.training.seq_len == 64  # the TOML's value where no override is given


def test_no_file_starts_from_022_defaults():
    """No --job.config_file: 0.2.2's defaults (llama3 "debugmodel") and the options."""
    platform.apply()
    config = parse_toml(["--training.steps", "2"])
    assert config.model_spec.name == "llama3" and config.model_spec.flavor == "debugmodel"
    assert config.training.steps == 2 and config.checkpoint.enable is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model.flavor", "huge"], "model.flavor 'huge' (model.name 'zephon_llama3'): llama3 has no flavor 'huge'; flavors: ["),
        (["--training.stepz", "3"], "Unknown option --training.stepz on the command line. Did you mean --training.steps?"),
        (["--job.config_file", "nope.toml"], "--job.config_file nope.toml is not a file; expected a TOML job config"),
    ],
)  # fmt: skip
def test_refusals_name_the_key(monkeypatch, argv, message):
    monkeypatch.chdir(ROOT)
    with pytest.raises(TomlConfigError) as e:
        parse_toml(["--job.config_file", str(TINY), *argv])
    assert str(e.value).startswith(message), str(e.value)


def test_a_family_without_a_toml_job_is_refused(monkeypatch):
    monkeypatch.delitem(configs.TOML_JOBS, "qwen3", raising=False)
    with pytest.raises(TomlConfigError) as e:
        parse_toml(["--job.config_file", str(TINY), "--model.name", "qwen3"])
    assert "model.name 'qwen3' selects the qwen3 family, which has no TOML job" in str(e.value)
    assert "--module torchtitan_zephon.configs --config FN" in str(e.value)


def test_the_front_end_is_chosen_by_the_absence_of_module_and_config():
    assert toml_front_end(["--job.config_file", "a.toml", "--training.steps", "2"])
    assert toml_front_end([])
    assert not toml_front_end(["--module", "llama3", "--config", "llama3_debugmodel"])
    assert not toml_front_end(["--config=llama3_debug"])


@pytest.mark.parametrize("front", ["toml", "registry"])
@pytest.mark.parametrize(
    "spelling",
    [
        ["--zephon.allow_changes", "seed", "skip_steps"],
        ["--zephon.allow_changes", "seed", "--zephon.allow_changes", "skip_steps"],
        ["--zephon.allow_changes", "seed,skip_steps"],
        ["--zephon.allow_changes=seed", "--zephon.allow-changes", "skip_steps"],
    ],
    ids=["one_flag", "repeated", "comma", "equals"],
)
def test_allow_changes_takes_several_fields_in_every_spelling(monkeypatch, front, spelling):
    """Issue 43 case 8: a repeated flag kept the last value, and two values after one
    flag failed in a tyro box (registry) or as an unknown option (TOML)."""
    from torchtitan_zephon.train import parse_config

    monkeypatch.chdir(ROOT)
    platform.apply()
    if front == "toml":
        config = parse_toml(["--job.config_file", str(TINY), *spelling, "--training.steps", "3"])
    else:
        base = ["--module", "torchtitan_zephon.configs", "--config", "llama3_tiny"]
        config = parse_config([*base, *spelling, "--training.steps", "3"])
    assert list(config.zephon.allow_changes) == ["seed", "skip_steps"]
    assert config.training.steps == 3


def test_a_refused_resume_names_the_flag_that_accepts_it():
    from torchtitan_zephon.order.data_config import DataStateMismatch
    from torchtitan_zephon.titan.start.decision import with_trainer_hint

    e = with_trainer_hint(DataStateMismatch("differs", ("seed", "skip_steps")))
    assert "--zephon.allow_changes seed skip_steps (TOML: [zephon] allow_changes = " in str(e)
    assert '["seed", "skip_steps"]' in str(e) and e.fields == ("seed", "skip_steps")


@pytest.mark.parametrize("front", ["toml", "registry"])
def test_a_value_torchtitan_refuses_is_one_line_naming_the_setting(monkeypatch, capsys, front):
    """Issue 43 case 14: --checkpoint.keep_latest_k 1 was refused in a tyro box (once per
    rank), which named neither the setting nor what works."""
    from torchtitan_zephon.train import parse_config

    monkeypatch.chdir(ROOT)
    platform.apply()
    flag = ["--checkpoint.keep_latest_k", "1"]
    with pytest.raises(ValueError) as e:
        if front == "toml":
            parse_toml(["--job.config_file", str(TINY), *flag])
        else:
            parse_config(
                ["--module", "torchtitan_zephon.configs", "--config", "llama3_tiny", *flag]
            )
    assert str(e.value).startswith("checkpoint.keep_latest_k = 1: TorchTitan keeps at least 2")
    assert "--checkpoint.keep_latest_k 2 or more, or 0" in str(e.value)
    assert "╭" not in capsys.readouterr().err  # no box


def test_torchtitans_note_on_its_own_default_is_not_logged(caplog):
    """Issue 43 case 15: 'initial_load_model_only=True has no effect without an
    initial_load_path' was logged for every job (its own default), several times."""
    import logging

    from torchtitan.components.checkpoint import CheckpointManager

    from torchtitan_zephon.configs import config_registry

    with caplog.at_level(logging.WARNING):
        config_registry.llama3_tiny()
        CheckpointManager.Config()
        logging.getLogger().warning("another warning still shows")
    assert not [r for r in caplog.records if "initial_load_model_only" in r.getMessage()]
    assert "another warning still shows" in caplog.text
