"""Engine knobs as command-line options, each declared once: on its dataclass field.

A field of `EngineConfig` or `ModelOptions` whose metadata carries a "help" is a knob. Its option is
derived from the field: the flag is `--` and the name with dashes (or the metadata's "flag"), the
type and the default are the field's, the help is the metadata's. A bool that defaults to False is a
plain flag (`--enforce-eager`); one that defaults to True, or whose metadata says "negatable", also
gets its negation (`--enable-prefix-caching/--no-enable-prefix-caching`). Fields without a help (`engine`, `progress`)
are not knobs.

`knob_options(...)` adds the knobs a command takes to its options and hands the command their values
as one `Knobs`, which builds the `EngineConfig` and `ModelOptions` when the command asks: inside its
own error handling, so a refused value is reported the command's way.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import typer

from engine.config import EngineConfig
from models.context_limit import OPT_IN_ENV
from models.registry import ModelOptions

HELP = "help"
FLAG = "flag"
NEGATABLE = "negatable"
_METADATA_KEYS = frozenset({HELP, FLAG, NEGATABLE})

# What a knob's option needs beyond its field and cannot say there: engine.config sits below models,
# so the opt-in's environment variable (models.context_limit) is named here, by its constant.
_OPTION_EXTRAS: dict[str, dict[str, Any]] = {"allow_long_max_model_len": {"envvar": OPT_IN_ENV}}

KNOBS_PARAMETER = "knobs"
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Knob:
    name: str  # the field's name; also the command parameter's
    owner: type  # EngineConfig or ModelOptions
    annotation: Any  # the field's type, resolved
    default: Any
    help: str
    flag: str
    negatable: bool = False

    def option(self, help_prefix: str = "") -> Any:
        """A fresh `typer.Option` for this knob (typed Any, as typer's own `Option` is)."""
        decls = self.flag
        if self.annotation in (bool, bool | None) and (self.default is True or self.negatable):
            decls = f"{self.flag}/--no-{self.flag.removeprefix('--')}"
        return typer.Option(
            self.default, decls, help=help_prefix + self.help, **_OPTION_EXTRAS.get(self.name, {})
        )


def knobs_of(owner: type) -> dict[str, Knob]:
    """The knobs among `owner`'s fields (those whose metadata carries a help), in field order."""
    knobs = {}
    types = typing.get_type_hints(owner)
    for f in dataclasses.fields(owner):
        if HELP not in f.metadata:
            continue
        unknown = set(f.metadata) - _METADATA_KEYS
        if unknown:
            raise TypeError(f"{owner.__name__}.{f.name}: unknown knob metadata {sorted(unknown)}")
        if f.default is dataclasses.MISSING:
            raise TypeError(f"{owner.__name__}.{f.name}: a knob needs a plain default")
        flag = f.metadata.get(FLAG, "--" + f.name.replace("_", "-"))
        knobs[f.name] = Knob(
            f.name, owner, types[f.name], f.default, f.metadata[HELP], flag, bool(f.metadata.get(NEGATABLE))
        )
    return knobs


def _all_knobs() -> dict[str, Knob]:
    engine, model = knobs_of(EngineConfig), knobs_of(ModelOptions)
    if both := engine.keys() & model.keys():
        raise TypeError(f"knobs declared by both EngineConfig and ModelOptions: {sorted(both)}")
    if stray := _OPTION_EXTRAS.keys() - engine.keys() - model.keys():
        raise TypeError(f"option extras for fields that are not knobs: {sorted(stray)}")
    return engine | model


# Every knob, EngineConfig's first, each in field order.
KNOBS: Mapping[str, Knob] = _all_knobs()


@dataclass(frozen=True, slots=True)
class Knobs:
    """The values a command was given for the knobs it takes; the others keep their field defaults."""

    values: Mapping[str, Any]

    def __post_init__(self) -> None:
        if unknown := set(self.values) - KNOBS.keys():
            raise KeyError(f"not engine knobs: {sorted(unknown)}")

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def _of(self, owner: type) -> dict[str, Any]:
        return {name: value for name, value in self.values.items() if KNOBS[name].owner is owner}

    def engine_config(self, **overrides: Any) -> EngineConfig:
        """The EngineConfig of these values, `overrides` winning; raises ContractError on a bad value."""
        return EngineConfig(**(self._of(EngineConfig) | overrides))

    def model_options(self, **overrides: Any) -> ModelOptions:
        """The ModelOptions of these values, with `engine_config()` as its engine unless overridden."""
        return ModelOptions(**({"engine": self.engine_config()} | self._of(ModelOptions) | overrides))


def knob_options(*names: str, help_prefix: str = "") -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Give a typer command the knobs `names` (none named: every knob) as options, after its own.

    The command declares a keyword-only parameter `knobs: Knobs` and receives the values in it. Its
    own options keep their meaning: one of its parameters named like a chosen knob is an error, so a
    command whose option means something else there (a list of policies) keeps it and does not take
    that knob. `help_prefix` goes before every knob's help (e.g. "--buckets: ")."""
    chosen = [KNOBS[name] for name in names] if names else list(KNOBS.values())

    def decorate(func: Callable[..., R]) -> Callable[..., R]:
        signature = inspect.signature(func)
        hints = typing.get_type_hints(func)
        if KNOBS_PARAMETER not in signature.parameters:
            raise TypeError(f"{func.__name__}: takes no `{KNOBS_PARAMETER}: Knobs` parameter")
        own = [
            p.replace(annotation=hints.get(p.name, p.annotation))
            for p in signature.parameters.values()
            if p.name != KNOBS_PARAMETER
        ]
        if clash := {p.name for p in own} & {knob.name for knob in chosen}:
            raise TypeError(f"{func.__name__}: its own parameters {sorted(clash)} are also knobs it takes")
        added = [
            inspect.Parameter(
                knob.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=knob.option(help_prefix),
                annotation=knob.annotation,
            )
            for knob in chosen
        ]

        @functools.wraps(func)
        def command(*args: Any, **kwargs: Any) -> R:
            values = {knob.name: kwargs.pop(knob.name) for knob in chosen}
            return func(*args, **kwargs, **{KNOBS_PARAMETER: Knobs(values)})

        # typer reads a command's options from inspect.signature (which stops at __signature__) and
        # typing.get_type_hints (which reads __annotations__): both get resolved types.
        returns = hints.get("return", signature.return_annotation)
        command.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[*own, *added], return_annotation=returns
        )
        command.__annotations__ = {p.name: p.annotation for p in [*own, *added]} | {"return": returns}
        return command

    return decorate
