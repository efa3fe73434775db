"""Settings declared once, each on its dataclass field: `setting(default, help, ...)` holds the
default, what the setting does, the values it accepts, its bounds and other projects' names
for it. Everything else is derived from the fields: the command line and its --help
(parse_cli), the RINGSERVE_* environment (read_env, to_env), the refusal of a value outside
its choices or bounds (check), and the README's table of settings (markdown_table).

An alias (vLLM's `--max-model-len` for `--context-length`, RINGSERVE_MAX_MODEL_LEN for
RINGSERVE_CONTEXT_LENGTH) is resolved in one place, merge_aliases, for flags and environment
alike: an alias and its setting given different values is an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "RINGSERVE_"
VALUE_ALIAS_DEST = "value_alias__"  # a value alias's, until parse_cli sets its setting
ALIAS_DEST = "alias__"  # an alias's argparse destination until merge_aliases moves it to its setting
TABLE_HEAD = "| flag | default | meaning |\n|---|---|---|\n"


@dataclass(frozen=True)
class Setting:
    """What the docs and the checks know of a setting; its name, type and default are its field's."""

    help: str  # Markdown: the README shows it as it is, --help without the backticks
    choices: tuple[str, ...] = ()  # the accepted values (and None where that is the default); (): any
    default_text: str | None = None  # the default in words, where its value alone does not say what it does
    unit: str = ""  # of a number in the docs
    aliases: tuple[str, ...] = ()  # other projects' names of it, spelled as field names
    short_flags: tuple[str, ...] = ()
    at_least: int | None = None
    positive: bool = False
    same_row: bool = False  # the README shows it in the row of the setting declared before it
    # a boolean's spellings as another project's flag with a value: (flag name, {value: the boolean})
    # (vLLM's `--task embed` for SGLang's `--is-embedding`); command line only
    value_aliases: tuple[tuple[str, tuple[tuple[str, bool], ...]], ...] = ()


def setting(
    default: Any,
    help: str,
    *,
    choices: Sequence[str] = (),
    default_text: str | None = None,
    unit: str = "",
    aliases: tuple[str, ...] = (),
    short_flags: tuple[str, ...] = (),
    at_least: int | None = None,
    positive: bool = False,
    same_row: bool = False,
    value_aliases: tuple[tuple[str, tuple[tuple[str, bool], ...]], ...] = (),
) -> Any:
    """A dataclass field: its default, and its Setting as metadata."""
    described = Setting(
        help, tuple(choices), default_text, unit, aliases, short_flags, at_least, positive, same_row, value_aliases
    )
    return dataclasses.field(default=default, metadata={"setting": described})


def settings_of(cls: type) -> Iterator[tuple[dataclasses.Field, Setting]]:
    for f in dataclasses.fields(cls):
        yield f, f.metadata["setting"]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def aliases_of(cls: type) -> dict[str, str]:
    """alias -> the field it names."""
    return {alias: f.name for f, s in settings_of(cls) for alias in s.aliases}


def list_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if _base_type(f.type) is tuple)


# ---------------------------------------------------------------- checks


def freeze_lists(obj: Any) -> None:
    """Each list setting of `obj` (a frozen dataclass) made a tuple of non-empty strings without
    commas: a JSON list (the engine's spec) or a string is read as parse_list reads it."""
    for name in list_fields(type(obj)):
        value = getattr(obj, name)
        if isinstance(value, str):
            value = parse_list(value)
        object.__setattr__(obj, name, tuple(value))
        if any(not isinstance(v, str) or not v or "," in v for v in value):
            raise ValueError(f"{flag(name)}: every value must be a non-empty string without commas")


def check(obj: Any) -> None:
    """A ValueError naming the flag of the first setting of `obj` outside its choices or bounds."""
    for f, s in settings_of(type(obj)):
        value = getattr(obj, f.name)
        if s.choices and value not in s.choices and not (value is None and f.default is None):
            raise ValueError(f"{flag(f.name)} must be one of {list(s.choices)}, not {value!r}")
        if s.at_least is not None and value < s.at_least:
            raise ValueError(f"{flag(f.name)} must be at least {s.at_least}")
        if s.positive and not value > 0:
            raise ValueError(f"{flag(f.name)} must be positive")


# ---------------------------------------------------------------- command line and environment


def parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    """Every setting's flag (and its aliases'), whose value is None unless given."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for f, s in settings_of(cls):
        _add_flag(parser, [flag(f.name), *s.short_flags], f.name, f.type, help_line(f, s))
    for alias, target in aliases_of(cls).items():
        help_ = f"= {flag(target)} (vLLM's name)"
        _add_flag(parser, [flag(alias)], ALIAS_DEST + alias, _field_type(cls, target), help_, target.upper())
    for f, s in settings_of(cls):
        for alias, values in s.value_aliases:
            words = ", ".join(f"{v} = {flag(f.name)} {'on' if b else 'off'}" for v, b in values)
            parser.add_argument(flag(alias), dest=VALUE_ALIAS_DEST + alias, choices=[v for v, _ in values], help=words)
    return parser


def parse_cli(cls: type, argv: Sequence[str] | None, prog: str, description: str) -> dict[str, Any]:
    """The settings given in `argv`, by field name."""
    given = {k: v for k, v in vars(parser(cls, prog, description).parse_args(argv)).items() if v is not None}
    for f, s in settings_of(cls):
        for alias, values in s.value_aliases:
            if VALUE_ALIAS_DEST + alias in given:
                word = given.pop(VALUE_ALIAS_DEST + alias)
                value = dict(values)[word]
                if given.get(f.name, value) != value:
                    raise ValueError(f"{flag(alias)} {word} and {flag(f.name)} conflict: they name the same setting")
                given[f.name] = value
    for name in list_fields(cls):  # several values, each a JSON or comma-separated list
        if name in given:
            given[name] = parse_list(given[name])
    return merge_aliases(cls, given, flag)


def read_env(cls: type, environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings given in `environ`'s RINGSERVE_* variables, by field name."""
    aliases = aliases_of(cls)
    values: dict[str, Any] = {}
    for name in [*(f.name for f in dataclasses.fields(cls)), *aliases]:
        raw = environ.get(env_name(name))
        if raw is None:
            continue
        kind = _base_type(_field_type(cls, aliases.get(name, name)))
        dest = ALIAS_DEST + name if name in aliases else name
        try:
            values[dest] = parse_list(raw) if kind is tuple else _parse_bool(raw) if kind is bool else kind(raw)
        except ValueError:
            raise ValueError(f"{env_name(name)}={raw!r} is not a valid {kind.__name__}") from None
    return merge_aliases(cls, values, env_name)


def to_env(obj: Any) -> dict[str, str]:
    """The environment that makes read_env() give back `obj`'s settings (None: unset)."""
    env = {}
    lists = list_fields(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name in lists:
            env[env_name(f.name)] = json.dumps(list(value))
        elif value is not None:
            env[env_name(f.name)] = str(value)
    return env


def merge_aliases(cls: type, given: dict[str, Any], spell: Callable[[str], str]) -> dict[str, Any]:
    """`given` (field or ALIAS_DEST + alias -> value) with each alias's value moved to its field;
    an alias and its field (or two aliases of it) given different values is a ValueError."""
    aliases = aliases_of(cls)
    values = {k: v for k, v in given.items() if not k.startswith(ALIAS_DEST)}
    named = {k: k for k in values}
    for key, value in given.items():
        if not key.startswith(ALIAS_DEST):
            continue
        alias = key[len(ALIAS_DEST) :]
        target = aliases[alias]
        if target in values and values[target] != value:
            raise ValueError(
                f"{spell(alias)} {value} and {spell(named[target])} {values[target]} conflict: "
                f"they name the same setting ({spell(target)})"
            )
        values[target], named[target] = value, alias
    return values


def parse_list(raw: str | Sequence[Any]) -> tuple[str, ...]:
    """A JSON list (vLLM's form: '["http://a", "http://b"]') or comma-separated values; several
    command-line values (nargs) are each read so and joined."""
    if not isinstance(raw, str):
        return tuple(v for item in raw for v in (parse_list(item) if isinstance(item, str) else (item,)))
    text = raw.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"{raw!r} is not a JSON list") from None
        if not isinstance(items, list):
            raise ValueError(f"{raw!r} is not a JSON list")
        return tuple(items)
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _add_flag(
    parser: argparse.ArgumentParser,
    names: list[str],
    dest: str,
    annotation: Any,
    help_: str,
    metavar: str | None = None,
) -> None:
    kind = _base_type(annotation)
    if kind is bool:
        parser.add_argument(*names, dest=dest, action="store_true", default=None, help=help_)
    elif kind is tuple:
        parser.add_argument(*names, dest=dest, nargs="*", default=None, help=help_)
    else:
        parser.add_argument(*names, dest=dest, type=kind, default=None, help=help_, metavar=metavar)


def _parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)


def _field_type(cls: type, name: str) -> Any:
    return {f.name: f.type for f in dataclasses.fields(cls)}[name]


def _base_type(annotation: Any) -> type:
    """`int | None` -> int; annotations are strings under `from __future__ import annotations`."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {"__builtins__": __builtins__}, {})
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    return typing.get_origin(annotation) or annotation


# ---------------------------------------------------------------- docs


def default_words(f: dataclasses.Field, s: Setting) -> str:
    """The default as the docs show it (Markdown)."""
    if s.default_text is not None:
        return s.default_text
    value = f.default
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == ():
        return "none"
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, tuple):
        return f"`{json.dumps(list(value))}`"
    number = str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
    return f"{number} {s.unit}" if s.unit else number


def help_line(f: dataclasses.Field, s: Setting) -> str:
    """The setting's --help text: argparse shows it as it is but for %-formatting, hence %%."""
    text = f"{s.help} (default: {default_words(f, s)})"
    return text.replace("`", "").replace("%", "%%")


def markdown_table(cls: type) -> str:
    """A Markdown table of the settings: flag (aliases), default, meaning; a setting marked
    same_row joins the row before it, its meaning after its flag's name."""
    rows: list[list[str]] = []
    for f, s in settings_of(cls):
        names = ", ".join(f"`{n}`" for n in [*map(flag, s.aliases), *s.short_flags])
        cells = [f"`{flag(f.name)}`" + (f" ({names})" if names else ""), default_words(f, s), s.help]
        if s.same_row and rows:
            row = rows[-1]
            row[0] += ", " + cells[0]
            row[1] += ", " + cells[1]
            row[2] += f"; `{flag(f.name)}`: {cells[2]}"
        else:
            rows.append(cells)
    return TABLE_HEAD + "".join(f"| {' | '.join(row)} |\n" for row in rows)


def with_table(markdown: str, table: str, heading: str) -> str:
    """`markdown` with the first table under the line `heading` replaced by `table`."""
    lines = markdown.splitlines(keepends=True)
    first = lines.index(heading + "\n")
    while not lines[first].startswith("|"):
        first += 1
    end = first
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "".join(lines[:first]) + table + "".join(lines[end:])
