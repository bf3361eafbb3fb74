"""FlashInfer's attention modules for sm_90a, built on the CPU machine so a device stretch does not
spend its first minutes JIT-compiling them.

FlashInfer loads ``<package>/data/aot/<name>/<name>.so`` as a ready module before it would build
``<name>`` (flashinfer/jit/env.py, ``get_aot_artifacts``); a module that fails to load there is
logged and built as usual, so a stale one costs nothing but the build it would have cost anyway.

  build OUT    here: writes OUT/<name>.so for every module the served geometries plan.
               scripts/stage_device.sh sets up what it needs (the wheels, curand's headers, a
               libcuda stub) and starts it.
  install SITE on the device after the wheels are installed into SITE: copies each .so beside this
               script's OUT into SITE/flashinfer/data/aot/<name>/.

The geometries: bf16 queries, KV and output, int32 indices, no positional encoding in the kernel,
no soft cap, fp32 QK reduction, with and without a sliding window, as
kernels/attention/flashinfer_backend.py plans them. A decode wrapper with tensor cores plans the
same prefill modules. fa3 (sm90) builds only up to FA3_MAX_HEAD_DIM, so 512 has fa2 alone.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

# (head dim, sliding window): Qwen3 128; Qwen3.5 and Gemma 3 global 256; Gemma 3/4 sliding 256;
# Gemma 4 global 512.
GEOMETRIES = ((128, False), (256, False), (256, True), (512, False))


def build(out: Path) -> None:
    import torch
    from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module, gen_batch_prefill_module

    from kernels.attention.flashinfer_backend import FA3_MAX_HEAD_DIM

    out.mkdir(parents=True, exist_ok=True)
    bf16 = torch.bfloat16
    for head_dim, sliding in GEOMETRIES:
        backends = ("fa2", "fa3") if head_dim <= FA3_MAX_HEAD_DIM else ("fa2",)
        for backend in backends:
            # fa2 plans its equal-stride primary module first (flashinfer/prefill.py,
            # get_batch_prefill_module); fa3 has one module.
            generate = _gen_batch_prefill_primary_module if backend == "fa2" else gen_batch_prefill_module
            spec = generate(
                backend, bf16, bf16, bf16, torch.int32, head_dim, head_dim, 0, sliding, False, False
            )
            started = time.time()
            spec.build(verbose=False)
            shutil.copy2(spec.jit_library_path, out / f"{spec.name}.so")
            print(f"{spec.name}: {time.time() - started:.0f} s", flush=True)


def install(site: Path) -> None:
    source = Path(__file__).resolve().parents[3] / ".fi-aot"
    modules = sorted(source.glob("*.so"))
    for module in modules:
        target = site / "flashinfer" / "data" / "aot" / module.stem
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(module, target / module.name)
    print(f"{len(modules)} prebuilt FlashInfer modules from {source} into {site}/flashinfer/data/aot")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("build", "install"):
        sys.exit("usage: flashinfer_aot.py build OUT | install SITE")
    (build if sys.argv[1] == "build" else install)(Path(sys.argv[2]))
