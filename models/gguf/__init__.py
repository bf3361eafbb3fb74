"""GGUF files as Hugging Face checkpoint directories.

`convert_gguf` writes config.json, the tokenizer files and safetensors from one GGUF file;
`converted_checkpoint` does it once per file into the infer cache (what `--model FILE.gguf`
loads); `embedded_gemma3_dir` does it for the Gemma 3 270M GGUF the project ships as a package.
What each library does: the gguf package reads the file, dequantizes every block and names the
GGUF tensor of each Hugging Face tensor; transformers' GGUF integration writes the config and the
tokenizer, and its model class, built on the meta device, states the tensor names and shapes.
"""

from models.gguf.cache import CACHE_ENV, cache_root, converted_checkpoint
from models.gguf.convert import DTYPES, ConvertResult, convert_gguf
from models.gguf.embedded import embedded_gemma3_dir
from models.gguf.errors import GGUFError, GGUFTensorsError, MissingGGUFDependencyError
from models.gguf.tensors import SUPPORTED_TYPES

__all__ = [
    "CACHE_ENV",
    "DTYPES",
    "SUPPORTED_TYPES",
    "ConvertResult",
    "GGUFError",
    "GGUFTensorsError",
    "MissingGGUFDependencyError",
    "cache_root",
    "convert_gguf",
    "converted_checkpoint",
    "embedded_gemma3_dir",
]
