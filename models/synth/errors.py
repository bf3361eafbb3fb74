"""Typed errors of `infer synth`; each carries the value that was refused."""

from __future__ import annotations


class SynthError(ValueError):
    """A synthetic checkpoint cannot be written as asked; the message says why."""


class UnknownFamilyError(SynthError):
    def __init__(self, family: str, known: tuple[str, ...]) -> None:
        super().__init__(f"unknown family {family!r}; known families: {', '.join(known)}")
        self.family = family


class UnknownPresetError(SynthError):
    def __init__(self, family: str, preset: str, known: tuple[str, ...]) -> None:
        super().__init__(f"family {family} has no preset {preset!r}; its presets: {', '.join(known)}")
        self.family = family
        self.preset = preset


class MissingDependencyError(SynthError):
    def __init__(self, package: str, purpose: str, install: str) -> None:
        super().__init__(f"{purpose} needs the {package!r} package, which is not installed: {install}")
        self.package = package


class OutputDirError(SynthError):
    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot write to {path}: {reason}")
        self.path = path


class InitRuleError(SynthError):
    """A tensor of the model has no initialisation rule: failing beats guessing a distribution."""

    def __init__(self, tensor: str, shape: tuple[int, ...]) -> None:
        super().__init__(
            f"no initialisation rule for tensor {tensor} of shape {list(shape)}: "
            "a newer transformers added a parameter that models/synth does not know yet"
        )
        self.tensor = tensor


class UnsupportedFormError(SynthError):
    """`--form` names a checkpoint form the family cannot write."""

    def __init__(self, family: str, form: str, known: tuple[str, ...]) -> None:
        super().__init__(f"--form {form}: family {family} cannot write it; its forms: {', '.join(known)}")
        self.family = family
        self.form = form
