"""The TOML front end: TorchTitan 0.2.2 spellings (a ``--job.config_file`` TOML and
``--section.key value`` overrides) translated onto the TorchTitan 0.3 config tree
(``Trainer.Config`` plus Zephon's ``zephon`` section), as tyro arguments.

Invariant: every key is read through ``toml_table.TABLE`` (the one table that owns
the mapping), and mapped to its 0.3 path, subsumed (accepted, and reported in
``TomlTranslation.consumed``), or refused with a ``TomlConfigError`` that names
the key as the user spelled it, where it came from, and its new spelling where one
exists. Nothing is silently ignored; an unknown key is refused with its close
matches. Command-line values win over the TOML file's.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torchtitan_zephon.configs.toml_table import (
    AC_MODES,
    COMPONENT_FIELDS,
    CONFIG_MODULE,
    MODEL_FAMILIES,
    NO_NOOP,
    TABLE,
    Entry,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = [
    "TomlConfigError",
    "TomlTranslation",
    "Setting",
    "check_against",
    "translate",
    "translate_toml",
]


class TomlConfigError(ValueError):
    """A 0.2.2 config key or value that cannot be carried onto TorchTitan 0.3."""


_AC_CLASS_MODES = {"SelectiveAC": "selective", "FullAC": "full", "MemoryBudgetAC": "memory_budget"}
_BETA_DEFAULTS = (0.9, 0.95)  # 0.2.2's, also default_adamw's


@dataclass(frozen=True)
class Setting:
    """One value for a 0.3 path. ``key``: the 0.2.2 key as spelled; ``origin``:
    "TOML file F" or "command line"."""

    path: str
    value: Any
    origin: str
    key: str


@dataclass(frozen=True)
class TomlTranslation:
    """The 0.3 reading of a 0.2.2 TOML file and command line."""

    settings: tuple[Setting, ...]
    """In order, the TOML file's first, then the command line's (later wins)."""
    model: str | None = None
    """0.3 model family from model.name, e.g. "llama3"."""
    model_name: str | None = None
    """model.name as given, e.g. "zephon_llama3"."""
    flavor: str | None = None
    config_file: str | None = None
    description: str | None = None
    consumed: tuple[Setting, ...] = ()
    """Keys accepted with nothing to set (subsumed, or a no-op value); path "" ."""

    def values(self) -> dict[str, Any]:
        """Each path's final value, in order of first appearance."""
        out: dict[str, Any] = {}
        for s in self.settings:
            out[s.path] = s.value
        return out

    def tyro_args(self, base: Any = None) -> list[str]:
        """Arguments for tyro over the 0.3 config (``ConfigManager``'s parse): the
        options, then the activation-checkpoint subcommand and its options (tyro
        applies options to the subcommand they follow). ``base``: the loaded config,
        needed when activation-checkpoint options come without a mode, and for an
        empty list (0.3's comma-separated list rule cannot spell one: it is left out
        where ``base`` already holds it, refused otherwise)."""
        last = {s.path: s for s in self.settings}
        mode = last.pop("activation_checkpoint", None)
        ac = [s for p, s in last.items() if p.startswith("activation_checkpoint.")]
        args: list[str] = []
        for s in last.values():
            if s not in ac:
                args += _render(s, base)
        if ac and mode is None:
            args.append(AC_MODES[_base_ac_mode(base, ac[0])])
        elif mode is not None:
            args.append(AC_MODES[mode.value])
        for s in ac:
            args += _render(s, base)
        return args


def _render(s: Setting, base: Any) -> list[str]:
    path, value = s.path, s.value
    if value == []:
        if base is not None and _held(base, path) == []:
            return []
        raise TomlConfigError(
            f"{_where(s, True)}: TorchTitan 0.3's command line cannot spell an empty list for "
            f"{path}, and the selected config does not hold one; set it in the config registry "
            "function, or remove the key."
        )
    if isinstance(value, bool):
        head, _, leaf = path.rpartition(".")
        return [f"--{path}" if value else f"--{head + '.' if head else ''}no-{leaf}"]
    if isinstance(value, tuple):
        return [f"--{path}", *(str(v) for v in value)]
    if isinstance(value, list):
        if all(isinstance(v, list) for v in value) and value:
            return [f"--{path}", *(",".join(v) for v in value)]
        return [f"--{path}", ",".join(str(v) for v in value)]
    return [f"--{path}", str(value)]


def _base_ac_mode(base: Any, first: Setting) -> str:
    where = _where(first)
    if base is None:
        raise TomlConfigError(
            f"{where} sets an activation-checkpoint option without activation_checkpoint.mode; "
            'set activation_checkpoint.mode ("selective", "full" or "memory_budget") as well.'
        )
    ac = getattr(base, "activation_checkpoint", None)
    if ac is None:
        raise TomlConfigError(
            f"{where} sets an activation-checkpoint option, but the selected config has no activation "
            'checkpointing; set activation_checkpoint.mode ("selective", "full" or "memory_budget") as well.'
        )
    name = type(ac).__qualname__.split(".")[0]
    if name not in _AC_CLASS_MODES:
        raise TomlConfigError(
            f"{where}: the selected config's activation checkpointing ({type(ac).__qualname__}) is not one of "
            f"{', '.join(_AC_CLASS_MODES)}; set activation_checkpoint.mode."
        )
    return _AC_CLASS_MODES[name]


def _where(s: Setting, with_value: bool = False) -> str:
    """Where a setting came from, as the user spelled it: "--training.dataset c4 on
    the command line", "training.dataset = 'c4' in TOML file F"."""
    if s.origin == "command line":
        shown = f" {_cli_text(s.value)}" if with_value and not isinstance(s.value, bool) else ""
        return f"--{s.key}{shown} on the command line"
    return f"{s.key}{f' = {s.value!r}' if with_value else ''} in {s.origin}"


def _cli_text(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(",".join(v) if isinstance(v, list) else str(v) for v in value) or "''"
    return str(value) if value != "" else "''"


def _suggest(key: str, prefix: str = "") -> str:
    scored = sorted(
        ((difflib.SequenceMatcher(None, key, k).ratio(), k) for k in TABLE), reverse=True
    )
    close = [k for r, k in scored[:3] if r >= 0.6 and r >= scored[0][0] - 0.05]  # the nearest only
    if not close:
        return "No known key is spelled like it; TorchTitan 0.2.2 keys are [section] key names (see docs/configs.md)."
    return "Did you mean " + " or ".join(prefix + c for c in close) + "?"


# 0.3 spellings accepted on the command line too: each path that one 0.2.2 key maps to
_BY_PATH: dict[str, str] = {}
for _e in TABLE.values():
    if _e.kind == "map":
        _BY_PATH.setdefault(_e.path, _e.key)


def _lookup(name: str) -> tuple[Entry, bool] | None:
    """The entry for a command-line option name (hyphens as underscores, 0.3
    paths allowed) and whether it is negated (``--section.no-key``)."""
    norm = name.replace("-", "_")
    for cand in (norm, _BY_PATH.get(norm, "")):
        if cand in TABLE:
            return TABLE[cand], False
    head, _, leaf = norm.rpartition(".")
    if leaf.startswith("no_"):
        found = _lookup(f"{head}.{leaf[3:]}" if head else leaf[3:])
        if found and found[0].value == "flag" and not found[1]:
            return found[0], True
    return None


def _parse_cli(argv: Sequence[str]) -> list[Setting]:
    """The command line as raw (key, value) settings; ``path`` holds the 0.2.2 key."""
    out: list[Setting] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--"):
            raise TomlConfigError(
                f"{tok!r} on the command line is not an option: options are spelled --section.key VALUE."
            )
        name, eq, inline = tok[2:].partition("=")
        found = _lookup(name)
        if found is None:
            norm = name.replace("-", "_")
            hint = _suggest(norm, "--")
            if norm.startswith("no_") and (flag := _lookup(norm[3:])) and flag[0].value == "flag":
                section, _, leaf = flag[0].key.rpartition(".")
                hint = f"A flag is turned off as --{section}.no-{leaf}."
            raise TomlConfigError(f"Unknown option --{name} on the command line. {hint}")
        entry, negated = found
        i += 1
        if entry.value == "flag":
            if eq:
                raise TomlConfigError(
                    f"--{name} on the command line is a flag and takes no value: spell --{name} to turn it on, "
                    f"--{_negation(name)} to turn it off."
                )
            value: Any = not negated
        elif entry.value == "lists":
            parts = [inline] if eq else []
            while not eq and i < len(argv) and not argv[i].startswith("--"):
                parts.append(argv[i])
                i += 1
            value = [p.split(",") for p in parts]
        else:
            if eq:
                value = inline
            elif i < len(argv) and not argv[i].startswith("--"):
                value = argv[i]
                i += 1
            else:
                raise TomlConfigError(
                    f"--{name} on the command line needs a value: --{name} VALUE."
                )
            if entry.value == "list":
                value = value.split(",") if value else []
        out.append(Setting(entry.key, value, "command line", name))
    return out


def _negation(name: str) -> str:
    head, _, leaf = name.rpartition(".")
    return f"{head}.no-{leaf}" if head else f"no-{leaf}"


def _flatten(table: dict[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for k, v in table.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _read_toml(path: str) -> list[Setting]:
    origin = f"TOML file {path}"
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise TomlConfigError(
            f"The config file {path} (--job.config_file) does not exist; give the path of a TOML job config, "
            "e.g. train_configs/debug_model.toml."
        ) from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise TomlConfigError(
            f"The config file {path} (--job.config_file) is not readable TOML: {e}."
        ) from None
    out = []
    for key, value in _flatten(data):
        if key not in TABLE:
            raise TomlConfigError(f"Unknown key {key} in {origin}. {_suggest(key)}")
        if key == "job.config_file":
            raise TomlConfigError(
                f"{key} in {origin}: a TOML file cannot name another; remove it (give the file with --job.config_file)."
            )
        if TABLE[key].value == "flag" and not isinstance(value, bool):
            raise TomlConfigError(f"{key} = {value!r} in {origin}: expected true or false.")
        out.append(Setting(key, value, origin, key))
    return out


def _same(value: Any, noop: Any) -> bool:
    if isinstance(value, str) and not isinstance(noop, str):
        return value == str(noop) or (isinstance(noop, list) and value == ",".join(noop))
    return type(value) is type(noop) and value == noop


def _resolve(raw: list[Setting], config_file: str | None) -> TomlTranslation:
    settings: list[Setting] = []
    consumed: list[Setting] = []
    picked: dict[str, Setting] = {}
    for s in raw:
        entry = TABLE[s.path]
        where = _where(s)
        if entry.kind == "map":
            settings.append(Setting(entry.path, s.value, s.origin, s.key))
        elif entry.kind == "subsumed":
            consumed.append(Setting("", s.value, s.origin, s.key))
        elif entry.kind == "renamed":
            raise TomlConfigError(f"{where} is now {entry.path} ({entry.why}); rename it.")
        elif entry.kind == "refused":
            if entry.noop is not NO_NOOP and _same(s.value, entry.noop):
                consumed.append(Setting("", s.value, s.origin, s.key))
                continue
            keep = (
                ""
                if entry.noop is NO_NOOP
                else f" (only {entry.noop!r}, its 0.2.2 default, is accepted)"
            )
            raise TomlConfigError(
                f"{_where(s, True)} has no equivalent in TorchTitan 0.3: {entry.why}{keep}; remove it."
            )
        else:
            picked[entry.key] = s  # later wins
            if entry.key in ("job.custom_config_module", "experimental.custom_args_module"):
                if s.value not in (CONFIG_MODULE, ""):
                    raise TomlConfigError(
                        f"{_where(s, True)}: TorchTitan 0.3 has no custom config modules; a job is a config "
                        f"registry function (--module M --config FN returning a Trainer.Config subclass). Only "
                        f"{CONFIG_MODULE!r}, which the Zephon configs subsume, is accepted; remove it."
                    )
                consumed.append(Setting("", s.value, s.origin, s.key))
            elif entry.key == "activation_checkpoint.mode":
                if s.value not in AC_MODES:
                    raise TomlConfigError(
                        f"{_where(s, True)}: expected one of {', '.join(map(repr, AC_MODES))}."
                    )
                settings.append(Setting("activation_checkpoint", s.value, s.origin, s.key))
            elif entry.key == "activation_checkpoint.selective_ac_option":
                if s.value != "op":
                    raise TomlConfigError(
                        f"{_where(s, True)} has no equivalent in TorchTitan 0.3: its selective activation "
                        'checkpointing is per-op ("op"), not every N-th block; set it to "op", or '
                        'activation_checkpoint.mode = "full", or remove it.'
                    )
                consumed.append(Setting("", s.value, s.origin, s.key))
            elif entry.key in ("optimizer.beta1", "optimizer.beta2"):
                try:
                    float(s.value)
                except (TypeError, ValueError):
                    raise TomlConfigError(
                        f"{_where(s, True)}: expected a number, e.g. 0.9."
                    ) from None
                b1, b2 = picked.get("optimizer.beta1"), picked.get("optimizer.beta2")
                betas = (
                    float(b1.value) if b1 else _BETA_DEFAULTS[0],
                    float(b2.value) if b2 else _BETA_DEFAULTS[1],
                )
                settings.append(Setting(entry.path, betas, s.origin, s.key))
    name, flavor = picked.get("model.name"), picked.get("model.flavor")
    family = None
    if name is not None:
        family = MODEL_FAMILIES.get(str(name.value))
        if family is None:
            raise TomlConfigError(
                f"{_where(name, True)} is not a model Zephon trains; expected one of "
                f"{', '.join(map(repr, MODEL_FAMILIES))}."
            )
    desc = next((str(s.value) for s in reversed(raw) if s.path == "job.description"), None)
    return TomlTranslation(
        settings=tuple(settings),
        model=family,
        model_name=None if name is None else str(name.value),
        flavor=None if flavor is None else str(flavor.value),
        config_file=config_file,
        description=desc,
        consumed=tuple(consumed),
    )


def translate_toml(path: str) -> TomlTranslation:
    """The 0.3 reading of a 0.2.2 TOML job config."""
    return _resolve(_read_toml(path), path)


def translate(argv: Sequence[str]) -> TomlTranslation:
    """The 0.3 reading of a 0.2.2 command line: the TOML named by
    ``--job.config_file`` (if any) first, then the options, which win."""
    cli = _parse_cli(argv)
    files = [s for s in cli if s.path == "job.config_file"]
    config_file = str(files[-1].value) if files else None
    toml = _read_toml(config_file) if config_file else []
    return _resolve(toml + cli, config_file)


def _step(node: Any, part: str) -> tuple[bool, Any]:
    if isinstance(node, list):
        ok = part.isdigit() and int(part) < len(node)
        return ok, node[int(part)] if ok else None
    if isinstance(node, dict):
        return part in node, node.get(part)
    names = {f.name for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else set()
    return part in names, getattr(node, part, None)


def _held(config: Any, path: str) -> Any:
    node = config
    for part in path.split("."):
        ok, node = _step(node, part)
        if not ok:
            return None
    return node


def check_against(config: Any, translation: TomlTranslation) -> None:
    """Refuse, naming the 0.2.2 key, any setting whose 0.3 path the loaded config
    (a ``Trainer.Config`` instance, e.g. a registry function's) does not have: a
    stock dataloader or validator without Zephon's fields, an optimizer without one
    catch-all parameter group, an activation-checkpoint option of another mode."""
    values = translation.values()
    mode = values.get("activation_checkpoint")
    for s in translation.settings:
        if s.path == "activation_checkpoint" or (
            mode is not None and s.path.startswith("activation_checkpoint.")
        ):
            continue  # the subcommand replaces the AC config; tyro checks its options
        node: Any = config
        for depth, part in enumerate(s.path.split(".")):
            ok, nxt = _step(node, part)
            if not ok:
                have = type(node).__qualname__
                missing = ".".join(s.path.split(".")[: depth + 1])
                extra = (
                    f" ({COMPONENT_FIELDS[s.path]} has it)" if s.path in COMPONENT_FIELDS else ""
                )
                raise TomlConfigError(
                    f"{_where(s)} maps to {s.path}, but the selected config has no {missing} (found {have})"
                    f"{extra}; choose a config that has it, or remove the key."
                )
            node = nxt
