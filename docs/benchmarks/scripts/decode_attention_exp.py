"""The split-KV decode attention's fp32 error on the GPU with each exponential: `tl.exp` (ex2.approx)
and libdevice's `exp`, against the spec's own error, both measured against the fp64 value.

tests/kernels/test_decode_attention.py bounds the kernel's error by 3x the spec's in fp32; on the
H200 at 9c95829 one geometry (4 query heads, 1 KV head, head dim 64) read 3.16x with `tl.exp`
(docs/kernels.md, "Split-KV decode attention"). This prints, per geometry and seed, the kernel's
largest error with each exponential over the spec's, so the cause is measured before any bound moves.

    python docs/benchmarks/scripts/decode_attention_exp.py [--seeds 4] [--save FILE]

Needs CUDA (TRITON_INTERPRET=1 runs it on the CPU, where both exponentials are numpy's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kernels.attention.base import AttentionLayerSpec, GroupBatch
from kernels.attention.torch_backend import TorchAttention
from kernels.kv_layout import PADDING_PAGE, PAGE_SIZE, pages_for
from kernels.reference import attend_one_sequence, paged_kv
from kernels.triton.decode_attention import PROGRAMS_PER_HEAD, SPLIT_TOKENS, decode_attention
from kernels.triton.storage import interpreted

S = SPLIT_TOKENS
# The test file's lengths (the long list at head dim 128, the short one elsewhere) and geometries
# (q heads, kv heads, head dim).
KV_LENS = (1, 15, 16, 17, S - 1, S, S + 1, 3 * S + 5, S * PROGRAMS_PER_HEAD + 37)
SHORT_KV_LENS = (1, 17, S + 1, 3 * S + 5)
GEOMETRIES = ((2, 2, 128), (8, 2, 128), (8, 1, 256), (4, 1, 64), (4, 2, 32))
# The CPU (under TRITON_INTERPRET=1, where both exponentials are numpy's) only to try the script.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def errors(heads: int, kv_heads: int, head_dim: int, seed: int) -> dict[str, float]:
    layer = AttentionLayerSpec(heads, kv_heads, head_dim, head_dim**-0.5, None)
    kv_lens = KV_LENS if head_dim == 128 else SHORT_KV_LENS
    g = torch.Generator().manual_seed(seed)
    pages = sum(pages_for(n) for n in kv_lens) + 4
    pool = torch.randn(pages, 2, PAGE_SIZE, kv_heads, head_dim, generator=g).to(DEVICE)
    order = (torch.randperm(pages - 1, generator=g) + 1).tolist()
    tables = []
    for n in kv_lens:
        tables.append(tuple(order[: pages_for(n)]))
        order = order[pages_for(n) :]
    q = torch.randn(len(kv_lens), heads, head_dim, generator=g).to(DEVICE)
    width = max(len(t) for t in tables)
    table = torch.full((len(kv_lens), width), PADDING_PAGE, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    table = table.to(DEVICE)
    lens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    exact = torch.cat(
        [
            attend_one_sequence(
                q[i : i + 1].double(),
                *(x.double() for x in paged_kv(pool, t, n, kv_heads, head_dim)),
                layer,
                accumulate=torch.float64,
            )
            for i, (n, t) in enumerate(zip(kv_lens, tables, strict=True))
        ]
    )
    backend = TorchAttention()
    backend.plan(0, GroupBatch((1,) * len(kv_lens), kv_lens, tuple(tables), PAGE_SIZE), layer)
    spec = (backend.run(0, layer, q, pool).double() - exact).abs().max().item()
    result = {"spec": spec}
    for name, libdevice in (("tl_exp", False), ("libdevice_exp", True)):
        out = decode_attention(q, pool, table, lens, layer, libdevice_exp=libdevice)
        result[name] = (out.double() - exact).abs().max().item()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--save", type=Path)
    args = parser.parse_args()
    if DEVICE.type != "cuda" and not interpreted():
        raise SystemExit("needs CUDA (or TRITON_INTERPRET=1 to try it on the CPU)")
    rows = []
    for geometry in GEOMETRIES:
        for seed in range(args.seeds):
            e = errors(*geometry, seed)
            rows.append({"geometry": geometry, "seed": seed, **e})
            print(
                f"{geometry} seed {seed}: spec {e['spec']:.3e}; tl.exp {e['tl_exp']:.3e} "
                f"({e['tl_exp'] / e['spec']:.2f}x); libdevice {e['libdevice_exp']:.3e} "
                f"({e['libdevice_exp'] / e['spec']:.2f}x)"
            )
    if args.save:
        args.save.write_text(
            json.dumps(
                {"device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu", "rows": rows},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
