"""`infer convert gguf FILE --out DIR`: write a GGUF file as a Hugging Face checkpoint directory."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from infer_cli.progress import RichProgress
from models.gguf import DTYPES, SUPPORTED_TYPES, ConvertResult, GGUFError, convert_gguf

convert_app = typer.Typer(
    help="Convert model files into Hugging Face checkpoint directories.", no_args_is_help=True
)


class DtypeChoice(StrEnum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def _counts(counter: dict[str, int]) -> str:
    return ", ".join(f"{key} ×{value}" for key, value in sorted(counter.items()))


def _summary(result: ConvertResult) -> Table:
    table = Table(title=f"infer convert gguf → {result.out}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("directory", str(result.out)),
        ("architecture / model type", f"{result.architecture} / {result.model_type}"),
        ("GGUF tensor types", _counts(result.gguf_types)),
        ("written dtypes", _counts(result.dtypes)),
        ("tensors", f"{result.num_tensors} ({result.num_parameters:,} parameters)"),
        ("weights", f"{result.total_bytes / 1e6:,.1f} MB in {', '.join(result.weight_files)}"),
        ("seconds", f"{result.seconds:.1f}"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


@convert_app.command(
    "gguf", help=f"GGUF file → config, tokenizer, safetensors. Types: {', '.join(SUPPORTED_TYPES)}."
)
def convert_gguf_command(
    file: Path = typer.Argument(..., help="The .gguf file."),
    out: Path = typer.Option(
        ..., "--out", help="Directory to write (created; must be empty unless --overwrite)."
    ),
    dtype: DtypeChoice = typer.Option(
        DtypeChoice.auto,
        "--dtype",
        help="Written dtype. auto: each tensor's own float type (F16, BF16 stay; F32 and every "
        "quantized type: float32, where dequantized values are exact).",
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace the checkpoint files (weights, config, tokenizer) in a non-empty --out; other files stay.",
    ),
    shard_gb: float = typer.Option(4.0, "--shard-gb", help="Largest safetensors shard, in GiB."),
) -> None:
    console = Console()
    try:
        result = convert_gguf(
            file,
            out,
            dtype=None if dtype is DtypeChoice.auto else DTYPES[dtype.value],
            overwrite=overwrite,
            shard_bytes=max(1, int(shard_gb * (1 << 30))),
            progress=RichProgress(console, keep=True),
        )
    except GGUFError as exc:
        console.print(f"infer convert gguf: {exc}", style="red", markup=False, highlight=False)
        raise typer.Exit(2) from exc
    console.print(_summary(result))
