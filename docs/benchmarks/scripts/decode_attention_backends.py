"""FlashInfer's paged decode kernels per backend at the serving geometries: which one a decode step
should plan, measured on the card at hand.

    python docs/benchmarks/scripts/decode_attention_backends.py [--batch-sizes 1,8,64] [--context 512]
        [--geometries qwen3-4b] [--backends fa2] [--layouts NHD,HND] [--page-sizes 16,32,64] [--save FILE]

`kernels/attention/flashinfer_backend.py` builds its decode wrappers with tensor cores and
backend "auto", which FlashInfer 0.7.2 resolves to fa2 for one-token decode rows. On the H100 at
df50211 that kernel took 2.4 ms of a 6.3 ms Qwen3-4B step at batch 64 (Gemma 4 12B: 5.0 of 15.3).
This times one layer's `run` (the median of `infer_cli.bench.timing.device_ms`, L2 flushed) for
fa2 and fa3 with tensor cores (and, with --cuda-cores, the CUDA-core decode kernel), each planned once over the
same pool (page size 16, every row `--context` tokens on shuffled pages), and reports the KV
bytes read over that time against the copy bandwidth measured in the same run. Each backend's
output is compared with fa2's (largest |difference|); a backend FlashInfer refuses for a
geometry is recorded with its error; fa3 is not asked past head dim 256. `--layouts` and
`--page-sizes` time the same rows in other pool layouts (HND: `[pages, 2, kv_heads, page, dim]`,
a head's tokens of a page contiguous) and page sizes than the engine's (NHD, 16: kernels/kv_layout.py),
to see what a layout change would give before making one. `--triton-splits` adds infer's split-KV
Triton kernel at each tokens-per-split size over the same rows (the sizes
`triton_decode_backend.SPLIT_TOKENS_BY_ROWS` may pick per batch). Needs CUDA and flashinfer.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch

from infer_cli.bench.timing import copy_gb_per_s, cuda_device, device_ms, versions
from kernels.kv_layout import PAGE_SIZE, ceil_div

# (name, q heads, kv heads, head dim, window): shared/presets.md. The windows are the serving ones,
# so the modules the latency runs built are reused (each new FlashInfer module is a minute of JIT).
GEOMETRIES = (
    ("qwen3-4b", 32, 8, 128, None),
    ("gemma4-12b sliding", 16, 8, 256, 1024),
    ("gemma4-12b global", 16, 1, 512, None),
)
# (label, use_tensor_cores, backend); fa3 has no kernel past head dim 256 (FA3_MAX_HEAD_DIM).
BACKENDS = (("fa2", True, "fa2"), ("fa3", True, "fa3"))
CUDA_CORES = ("cuda-cores", False, "auto")


def measure(
    geometry: tuple[str, int, int, int, int | None],
    batch: int,
    context: int,
    device: torch.device,
    copy_gbs: float,
    backends: tuple[tuple[str, bool, str], ...],
    layout: str = "NHD",
    page_size: int = PAGE_SIZE,
    triton_splits: tuple[int, ...] = (),
) -> list[dict]:
    import flashinfer

    from kernels.attention.flashinfer_backend import FA3_MAX_HEAD_DIM

    name, heads, kv_heads, head_dim, window = geometry
    pages_per_row = ceil_div(context, page_size)
    pages = batch * pages_per_row + 1
    gen = torch.Generator().manual_seed(batch)
    page_shape = (page_size, kv_heads) if layout == "NHD" else (kv_heads, page_size)
    pool = torch.randn(pages, 2, *page_shape, head_dim, generator=gen).to(torch.bfloat16).to(device)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(torch.bfloat16).to(device)
    order = (torch.randperm(pages - 1, generator=gen) + 1).to(torch.int32)
    indices = order[: batch * pages_per_row].to(device)
    indptr = torch.arange(0, batch * pages_per_row + 1, pages_per_row, dtype=torch.int32)
    last = torch.full((batch,), context - (pages_per_row - 1) * page_size, dtype=torch.int32)
    kv_bytes = batch * context * 2 * kv_heads * head_dim * pool.element_size()
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
    rows: list[dict] = []
    reference: torch.Tensor | None = None
    for label, tensor_cores, backend in backends:
        row: dict = {
            "geometry": name,
            "batch": batch,
            "context": context,
            "backend": label,
            "layout": layout,
            "page_size": page_size,
        }
        if backend == "fa3" and head_dim > FA3_MAX_HEAD_DIM:
            continue
        try:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, layout, use_tensor_cores=tensor_cores, backend=backend
            )
            wrapper.plan(
                indptr, indices, last, heads, kv_heads, head_dim, page_size,
                sm_scale=head_dim**-0.5, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                window_left=-1 if window is None else window - 1,
            )  # fmt: skip
            out = wrapper.run(q, pool)
            ms = device_ms(partial(wrapper.run, q, pool))
        except Exception as exc:  # a backend FlashInfer refuses here is a result, not a crash
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            continue
        if reference is None:
            reference = out
        row |= {
            "ms": ms,
            "kv_gb_per_s": kv_bytes / (ms * 1e-3) / 1e9,
            "pct_of_copy": 100 * kv_bytes / (ms * 1e-3) / 1e9 / copy_gbs,
            "max_abs_diff_vs_fa2": float((out.float() - reference.float()).abs().max()),
        }
        rows.append(row)
    if triton_splits and layout == "NHD" and page_size == PAGE_SIZE:
        rows += _triton_rows(
            geometry, batch, context, pool, q, indices, kv_bytes, copy_gbs, triton_splits, reference
        )
    return rows


def _triton_rows(
    geometry: tuple[str, int, int, int, int | None],
    batch: int,
    context: int,
    pool: torch.Tensor,
    q: torch.Tensor,
    indices: torch.Tensor,
    kv_bytes: int,
    copy_gbs: float,
    splits: tuple[int, ...],
    reference: torch.Tensor | None,
) -> list[dict]:
    """The split-KV Triton decode kernel (kernels/triton/decode_attention.py) over the same pool and
    rows, once per tokens-per-split size, its split and merge launches timed together."""
    from kernels.attention.base import AttentionLayerSpec
    from kernels.triton.decode_attention import (
        DecodeAttentionError,
        DecodeGeometry,
        DecodeScratch,
        decode_attention,
    )

    name, heads, kv_heads, head_dim, window = geometry
    layer = AttentionLayerSpec(heads, kv_heads, head_dim, head_dim**-0.5, window)
    table = indices.view(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int32, device=q.device)
    scratch = DecodeScratch.allocate(DecodeGeometry.of(layer), batch, q.device)
    out = torch.empty_like(q)
    rows = []
    for split in splits:
        row: dict = {"geometry": name, "batch": batch, "context": context, "backend": f"triton-s{split}",
                     "layout": "NHD", "page_size": PAGE_SIZE}  # fmt: skip
        try:
            run = partial(
                decode_attention, q, pool, table, lens, layer, scratch=scratch, out=out, split_tokens=split
            )
            run()
            ms = device_ms(run)
        except DecodeAttentionError as exc:  # a geometry the kernel does not take (head dim 512)
            row["error"] = str(exc)[:300]
            rows.append(row)
            continue
        diff = float((out.float() - reference.float()).abs().max()) if reference is not None else float("nan")
        row |= {
            "ms": ms,
            "kv_gb_per_s": kv_bytes / (ms * 1e-3) / 1e9,
            "pct_of_copy": 100 * kv_bytes / (ms * 1e-3) / 1e9 / copy_gbs,
            "max_abs_diff_vs_fa2": diff,
        }
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument(
        "--cuda-cores", action="store_true", help="also the CUDA-core decode kernel (new JIT modules)"
    )
    parser.add_argument(
        "--geometries",
        default=",".join(g[0] for g in GEOMETRIES),
        help="which of the geometries (by name) to time",
    )
    parser.add_argument("--backends", default="fa2,fa3", help="which tensor-core backends to time")
    parser.add_argument("--layouts", default="NHD", help="pool layouts to time: NHD (the engine's), HND")
    parser.add_argument("--page-sizes", default=str(PAGE_SIZE), help="tokens per page to time")
    parser.add_argument(
        "--triton-splits",
        default="",
        help="also the Triton decode kernel at these tokens per split (NHD, 16-token pages), e.g. 64,128,256,512",
    )
    parser.add_argument("--save", type=Path)
    args = parser.parse_args()
    splits = tuple(int(s) for s in args.triton_splits.split(",") if s)
    named = args.backends.split(",")
    geometries = [g for g in GEOMETRIES if g[0] in args.geometries.split(",")]
    backends = tuple(b for b in BACKENDS if b[0] in named) + ((CUDA_CORES,) if args.cuda_cores else ())
    device = cuda_device()
    copy_gbs = copy_gb_per_s(device)
    rows = [
        row
        for geometry in geometries
        for batch in (int(b) for b in args.batch_sizes.split(","))
        for layout in args.layouts.split(",")
        for page_size in (int(p) for p in args.page_sizes.split(","))
        for row in measure(
            geometry, batch, args.context, device, copy_gbs, backends, layout, page_size, splits
        )
    ]
    for row in rows:
        what = f"{row['geometry']:20} bs {row['batch']:3} {row['layout']} p{row['page_size']:<3} {row['backend']:10}"
        if "error" in row:
            print(f"{what} refused: {row['error'][:100]}")
        else:
            print(
                f"{what} {row['ms'] * 1e3:8.1f} us "
                f"{row['pct_of_copy']:5.1f} % of copy  |Δ| vs fa2 {row['max_abs_diff_vs_fa2']:.3g}"
            )
    if args.save:
        meta = {"device": torch.cuda.get_device_name(device), "copy_gb_per_s": copy_gbs, **versions()}
        args.save.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
