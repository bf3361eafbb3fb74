"""The fused decode MMA (kernels/triton/fused_mma.py) at small shapes: under the interpreter on a
CPU, compiled on a GPU when there is one; plus an sm_90 compile check of every variant with PDL.

Shapes: N = 40 output columns (a masked last program at 16 columns per program), K = 64, 96 and 160
(masked tails in 128- and 256-wide K tiles, and 2-5 tiles of 32 with ``SETTINGS["k32"]``, which run
the peeled first tile and the pipelined loop); M = 5 and 16 (the 16-row block), 20 and 64 (the
64-row block).

Against the spec (``reference.norm_linear`` / ``linear_residual`` / ``linear_gated``), with the
bounds of ``fused_bounds.py``, each built from what the spec's own freedoms cost, measured in the
same run (the linear's reordering bound; the spec's norm with its squares summed in other orders
moving no bf16/fp16 element, asserted here on these operands; the gated bound as the spec's own move
at the perturbed gate and up). Against the unfused kernels, bit for bit: the fused norm equals the
plain kernel of ``invariant_rms_norm``'s output on hidden rows whose sum of squares no order can
move (``fused_bounds.order_free_rows``), the gated one ``gated_act`` of the plain kernel, the
residual one torch's rounded add. Metamorphic, bit for bit: row offset 1 against 0 with sentinel
rows and columns untouched; a row alone and a few rows against the same rows inside a full block, in
each row-block size; two runs.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from fused_bounds import (
    DEVICE,
    TRANSCENDENTAL_SHARE,
    check_within,
    gated_allowed,
    linear_allowed,
    norm_linear_allowed,
    norm_order_flips,
    order_free_rows,
)
from linear_bounds import FLIP_SHARE_BOUND, agreement, ulp
from sm90_compile import compiled_variants

from kernels import reference
from kernels.reference import GatedActivation, NormSpec, NormWeight
from kernels.triton.fused_gemv import Fusion
from kernels.triton.fused_mma import (
    CANDIDATE_SHAPE,
    COMPILE_VARIANTS,
    MAX_PIPELINE_BYTES,
    MAX_ROWS,
    ROW_BLOCKS,
    FusedMmaError,
    MmaSettings,
    fused_mma,
    mma_candidates,
    mma_settings,
    ptx_problems,
    row_block,
)

N = 40
KS = (64, 96, 160)
ROWS = (5, 16, 20, MAX_ROWS)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SETTINGS = {
    "default": None,
    "k32": MmaSettings(block_n=16, block_k=32, num_stages=3),
    "n64": MmaSettings(block_n=64, block_k=64, num_stages=2),
}
QWEN3_NORM = NormSpec(NormWeight.W, eps=1e-6, round_before_weight=True)
NORMS = (QWEN3_NORM, NormSpec(NormWeight.ONE_PLUS_W), NormSpec(NormWeight.NONE))
# Multi-tile K everywhere below: the norm's first pass and the pipelined loop both run.
K32 = SETTINGS["k32"]


def _ids(values: tuple[object, ...]) -> list[str]:
    return [str(v).removeprefix("torch.") for v in values]


def _tensors(m: int, k: int, dtype: torch.dtype, *, seed: int = 3) -> dict[str, torch.Tensor]:
    """x (or the hidden rows), a weight w ~ N(0, 1/K), a norm weight near 1 and a residual."""
    g = torch.Generator().manual_seed(seed + k + 1000 * m)
    made = {
        "x": torch.randn(m, k, generator=g) * 2,
        "w": torch.randn(N, k, generator=g) / k**0.5,
        "norm_weight": 1 + 0.3 * torch.randn(k, generator=g),
        "residual": torch.randn(m, N, generator=g) * 4,
        "gate_up": torch.randn(2 * N, k, generator=g) * (3 / k**0.5),  # gates out to ±8: silu's tails
    }
    return {name: t.to(dtype).to(DEVICE) for name, t in made.items()}


# --------------------------------------------------------------------------------- against the spec


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("name", list(SETTINGS))
def test_plain_mma_is_the_spec_within_the_reordering_bound(name: str, dtype: torch.dtype) -> None:
    for k, m in itertools.product(KS, ROWS):
        t = _tensors(m, k, dtype)
        y = fused_mma(t["x"], t["w"], settings=SETTINGS[name])
        assert y.shape == (m, N) and y.dtype == dtype
        verdict = agreement(y, reference.linear(t["x"].cpu(), t["w"].cpu()), t["x"], t["w"])
        assert verdict.ok, f"K={k} M={m}: {verdict}"


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("spec", NORMS, ids=lambda s: f"{s.weight.value}-rbw{int(s.round_before_weight)}")
def test_norm_prologue_is_the_spec_within_the_reordering_bound(spec: NormSpec, dtype: torch.dtype) -> None:
    for k, m, settings in itertools.product(KS, (5, 20), (None, K32)):
        t = _tensors(m, k, dtype)
        nw = None if spec.weight is NormWeight.NONE else t["norm_weight"]
        y = fused_mma(t["x"], t["w"], Fusion(norm=spec), settings, norm_weight=nw)
        want = reference.norm_linear(t["x"].cpu(), spec, None if nw is None else nw.cpu(), t["w"].cpu())
        allowed, moved_share = norm_linear_allowed(t["x"], spec, nw, t["w"])
        check_within(y, want, allowed, FLIP_SHARE_BOUND[dtype] + moved_share)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
def test_residual_epilogue_is_the_spec_within_the_bound(dtype: torch.dtype) -> None:
    for k, m, settings in itertools.product(KS, (5, 20), (None, K32)):
        t = _tensors(m, k, dtype)
        y = fused_mma(t["x"], t["w"], Fusion(residual=True), settings, residual=t["residual"])
        x, w = t["x"].cpu(), t["w"].cpu()
        want = reference.linear_residual(x, w, t["residual"].cpu())
        allowed = linear_allowed(x, w, reference.linear(x, w))
        if dtype != torch.float32:  # one rounding of the add
            allowed = allowed + ulp(want, dtype)
        check_within(y, want, allowed, FLIP_SHARE_BOUND[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("kind", tuple(GatedActivation), ids=lambda k: k.value)
@pytest.mark.parametrize("with_norm", [False, True], ids=["gated", "norm-gated"])
def test_gated_epilogue_is_the_spec_within_the_bound(
    with_norm: bool, kind: GatedActivation, dtype: torch.dtype
) -> None:
    for k, m, settings in itertools.product(KS, (5, 20), (None, K32)):
        t = _tensors(m, k, dtype)
        fusion = Fusion(norm=QWEN3_NORM if with_norm else None, activation=kind)
        nw = t["norm_weight"] if with_norm else None
        y = fused_mma(t["x"], t["gate_up"], fusion, settings, norm_weight=nw)
        assert y.shape == (m, N) and y.dtype == dtype
        x = (
            reference.rms_norm(t["x"].cpu(), QWEN3_NORM, t["norm_weight"].cpu())
            if with_norm
            else t["x"].cpu()
        )
        # The gated bound holds the normalised rows fixed: rows whose spec norm moves when its
        # squares are summed in another order are left to the norm prologue's test (measured here:
        # 1 of 20 fp16 rows at K = 96, none in bf16).
        stable = [
            r
            for r in range(m)
            if not with_norm
            or dtype == torch.float32
            or not norm_order_flips(t["x"][r : r + 1], QWEN3_NORM, nw)
        ]
        assert len(stable) >= m - 1, f"K={k} M={m}: rows {stable} order-stable"
        rows = stable
        want = reference.linear_gated(x[rows], t["gate_up"].cpu(), kind)
        share = 2 * FLIP_SHARE_BOUND[dtype] + TRANSCENDENTAL_SHARE
        check_within(y[rows], want, gated_allowed(x[rows], t["gate_up"], kind), share)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
def test_fused_variants_are_the_unfused_kernels_composed_bit_for_bit(dtype: torch.dtype) -> None:
    from kernels.triton.gated_act import gated_act
    from kernels.triton.invariant_rmsnorm import invariant_rms_norm

    for k, m in itertools.product(KS, (5, 20)):
        t = _tensors(m, k, dtype)
        x, w, gu, nw = t["x"], t["w"], t["gate_up"], t["norm_weight"]
        # The kernel sums the squares in K tiles, invariant_rms_norm over the whole row: on hidden
        # rows whose sum of squares is exact in fp32 the two orders agree, and so must the bits.
        hidden = order_free_rows(m, k, dtype)
        normed = invariant_rms_norm(hidden, QWEN3_NORM, nw)
        fused_norm = fused_mma(hidden, w, Fusion(norm=QWEN3_NORM), K32, norm_weight=nw)
        assert torch.equal(fused_norm, fused_mma(normed, w, settings=K32)), f"K={k} M={m}: norm"
        residual = fused_mma(x, w, Fusion(residual=True), K32, residual=t["residual"])
        assert torch.equal(residual, t["residual"] + fused_mma(x, w, settings=K32)), f"K={k} M={m}: residual"
        for kind in GatedActivation:
            gated = fused_mma(x, gu, Fusion(activation=kind), K32)
            assert torch.equal(gated, gated_act(fused_mma(x, gu, settings=K32), kind)), f"K={k}: {kind.value}"


def test_the_bounds_reject_a_kernel_that_rounds_per_k_tile() -> None:
    # What the bound exists to catch here: the K loop's partial sums rounded to bf16 per tile.
    t = _tensors(20, 160, torch.bfloat16)
    x, w = t["x"].cpu(), t["w"].cpu()
    parts = [reference.linear(x[:, i : i + 32], w[:, i : i + 32]).float() for i in range(0, 160, 32)]
    wrong = torch.stack(parts).sum(0).to(torch.bfloat16)
    assert not agreement(wrong, reference.linear(x, w), x, w).ok


# -------------------------------------------------------------------------------------- metamorphic

FUSIONS = {
    "plain": Fusion(),
    "norm": Fusion(norm=QWEN3_NORM),
    "residual": Fusion(residual=True),
    "norm-silu": Fusion(norm=QWEN3_NORM, activation=GatedActivation.SILU),
}


def _run(
    fusion: Fusion,
    t: dict[str, torch.Tensor],
    x: torch.Tensor,
    rows: slice | None = None,
    settings: MmaSettings | None = K32,
    **kw: torch.Tensor,
) -> torch.Tensor:
    weight = t["gate_up"] if fusion.activation else t["w"]
    nw = t["norm_weight"] if fusion.norm else None
    if fusion.residual and rows is not None:
        kw["residual"] = t["residual"][rows]
    return fused_mma(x, weight, fusion, settings, norm_weight=nw, **kw)


def _into_sentinels(fusion: Fusion, t: dict[str, torch.Tensor], offset: int) -> tuple[torch.Tensor, bool]:
    """Run with x, the residual and the output ``offset`` rows into wider buffers (junk input rows
    around them, row strides that are not K or N) and sentinel output rows and columns around the
    result. Returns (the written rows, whether every sentinel is unchanged)."""
    x, dtype = t["x"], t["x"].dtype
    m, k = x.shape
    x_buf = torch.full((m + 2, k + 16), 1e4, dtype=dtype, device=DEVICE)
    x_buf[offset : offset + m, :k] = x
    extra: dict[str, torch.Tensor] = {}
    if fusion.residual:
        r_buf = torch.full((m + 2, N + 8), -1e4, dtype=dtype, device=DEVICE)
        r_buf[offset : offset + m, :N] = t["residual"]
        extra["residual"] = r_buf[offset : offset + m, :N]
    sentinel = torch.full((m + 2, N + 8), -7.0, dtype=dtype, device=DEVICE)
    y_buf = sentinel.clone()
    _run(fusion, t, x_buf[offset : offset + m, :k], out=y_buf[offset : offset + m, :N], **extra)
    outside = torch.ones_like(y_buf, dtype=torch.bool)
    outside[offset : offset + m, :N] = False
    return y_buf[offset : offset + m, :N], torch.equal(y_buf[outside], sentinel[outside])


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("name", list(FUSIONS))
def test_row_offset_one_matches_offset_zero_and_leaves_sentinels(name: str, dtype: torch.dtype) -> None:
    fusion = FUSIONS[name]
    for m in (5, 20):
        t = _tensors(m, 96, dtype)
        at_zero, kept_zero = _into_sentinels(fusion, t, 0)
        at_one, kept_one = _into_sentinels(fusion, t, 1)
        assert kept_zero and kept_one, f"M={m}: an element outside the output rows and columns changed"
        assert torch.equal(at_one, at_zero), f"M={m}: offset 1 differs from offset 0"
        fresh = _run(fusion, t, t["x"], slice(None))
        assert torch.equal(fresh, at_zero), f"M={m}: a fresh output differs"


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids(DTYPES))
@pytest.mark.parametrize("name", list(FUSIONS))
def test_rows_alone_match_the_rows_in_a_full_block_of_their_size(name: str, dtype: torch.dtype) -> None:
    fusion = FUSIONS[name]
    for block in ROW_BLOCKS:
        t = _tensors(block, 160, dtype)
        batch = _run(fusion, t, t["x"], slice(None))
        # The smallest step of the block: one row (16-row block) or 17 rows (64-row block).
        smallest = 1 if block == ROW_BLOCKS[0] else ROW_BLOCKS[0] + 1
        for start in (0, 3, block - smallest):
            rows = slice(start, start + smallest)
            alone = _run(fusion, t, t["x"][rows], rows)
            assert torch.equal(alone, batch[rows]), f"block {block}: rows {start}..{start + smallest - 1}"
        few = 5 if block == ROW_BLOCKS[0] else 20
        head = _run(fusion, t, t["x"][:few], slice(0, few))
        assert torch.equal(head, batch[:few]), f"block {block}: the first {few} rows"


@pytest.mark.parametrize("name", list(FUSIONS))
def test_two_runs_are_identical(name: str) -> None:
    fusion = FUSIONS[name]
    for dtype, m in itertools.product(DTYPES, (5, 20)):
        t = _tensors(m, 160, dtype)
        first, second = _run(fusion, t, t["x"], slice(None)), _run(fusion, t, t["x"], slice(None))
        assert torch.equal(first, second), (dtype, m)


def test_empty_batch() -> None:
    t = _tensors(1, 64, torch.bfloat16)
    assert fused_mma(t["x"][:0], t["w"]).shape == (0, N)


# ------------------------------------------------------------------------------- settings, refusals


def test_settings_follow_the_weight_shape_and_row_block_only() -> None:
    assert [row_block(m) for m in (1, 5, 16, 17, 64)] == [16, 16, 16, 64, 64]
    # Qwen3-4B: the widest block_n that keeps ≥ 128 programs; K tiles 256 wide at 16 rows, 128 at 64.
    assert mma_settings(6144, 2560, 16) == MmaSettings(block_n=32, block_k=256, num_stages=4)
    assert mma_settings(2560, 4096, 64) == MmaSettings(block_n=16, block_k=128, num_stages=4)
    assert mma_settings(9728, 2560, 64, gated=True).block_n == 32  # two tiles per stage: at most 32
    assert mma_settings(151936, 2560, 16).block_n == 64
    # fp32 at 64 rows: 4 stages of [64 + 64, 128] would pass the shared-memory budget; 3 do not.
    assert mma_settings(151936, 2560, 64, element=4).num_stages == 3
    for m in (5, 16):
        assert mma_settings(6144, 2560, row_block(m)) == mma_settings(6144, 2560, 16)
    for block in ROW_BLOCKS:  # what the benchmark times: the default first, distinct, all fitting
        candidates = mma_candidates(2560, 4096, block)
        assert (
            candidates[0] == mma_settings(2560, 4096, block) and len(set(candidates)) == len(candidates) > 3
        )
        assert any(not c.pdl for c in candidates)
        assert all(c.pipeline_bytes(block, 2) <= MAX_PIPELINE_BYTES for c in candidates)
    # fp32 gated at 64 rows: the [64 + 2·32, 256] × 3-stage candidate (384 KB) is left out.
    fp32_gated = mma_candidates(9728, 2560, 64, gated=True, element=4)
    assert MmaSettings(block_n=32, block_k=256, num_stages=3, num_warps=8) not in fp32_gated
    assert fp32_gated and all(c.pipeline_bytes(64, 4, gated=True) <= MAX_PIPELINE_BYTES for c in fp32_gated)
    with pytest.raises(FusedMmaError, match="block_n=24"):
        MmaSettings(block_n=24)
    with pytest.raises(FusedMmaError, match="block_k=8"):
        MmaSettings(block_k=8)
    with pytest.raises(FusedMmaError, match="num_stages=0"):
        MmaSettings(num_stages=0)


def test_refusals_name_the_shape() -> None:
    t = _tensors(MAX_ROWS + 1, 64, torch.bfloat16)
    x, w = t["x"], t["w"]
    with pytest.raises(FusedMmaError, match=r"gemv \(mma\) x \[65, 64\] @ w \[40, 64\].*M=65.*at most 64"):
        fused_mma(x, w)
    with pytest.raises(FusedMmaError, match=r"\[8, 40\].*K=40 is not a positive multiple of 16"):
        fused_mma(x[:8, :40], w[:, :40].contiguous())
    with pytest.raises(FusedMmaError, match=r"dtypes x=torch\.bfloat16, weight=torch\.float32"):
        fused_mma(x[:8], w.float())
    with pytest.raises(FusedMmaError, match="last dim has stride 2"):
        fused_mma(x[:8, ::2], w[:, :32].contiguous())
    with pytest.raises(FusedMmaError, match="weight must be contiguous"):
        fused_mma(x[:8], torch.cat([w, w], dim=1)[:, :64])
    with pytest.raises(FusedMmaError, match=r"n64·k512x4.*pipeline holds 524288 bytes .* at 64 rows"):
        fused_mma(x[:20], w, settings=MmaSettings(block_n=64, block_k=512))
    with pytest.raises(FusedMmaError, match="N=41 is odd"):
        fused_mma(
            x[:8],
            torch.zeros(41, 64, dtype=torch.bfloat16, device=DEVICE),
            Fusion(activation=GatedActivation.SILU),
        )
    with pytest.raises(FusedMmaError, match="norm weight 'w' was given norm_weight=None"):
        fused_mma(x[:8], w, Fusion(norm=QWEN3_NORM))
    with pytest.raises(FusedMmaError, match=r"norm_weight is \(32,\)"):
        fused_mma(x[:8], w, Fusion(norm=QWEN3_NORM), norm_weight=t["norm_weight"][:32])
    with pytest.raises(FusedMmaError, match="norm_weight was given without a norm spec"):
        fused_mma(x[:8], w, norm_weight=t["norm_weight"])
    with pytest.raises(FusedMmaError, match=r"residual=None for gemv\+residual"):
        fused_mma(x[:8], w, Fusion(residual=True))
    with pytest.raises(FusedMmaError, match=r"residual is \(9, 40\).*not \[8, 40\]"):
        fused_mma(x[:8], w, Fusion(residual=True), residual=t["residual"][:9])
    with pytest.raises(FusedMmaError, match=r"out is \(8, 39\)"):
        fused_mma(x[:8], w, out=torch.empty(8, 39, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(FusedMmaError, match=r"x \(64,\), weight \(40, 64\)"):
        fused_mma(x[0], w)


# ----------------------------------------------------------------------------- sm_90 compile check


def test_every_variant_compiles_for_sm90_with_pdl_tensor_cores_and_16_byte_loads() -> None:
    compiled = compiled_variants("kernels.triton.fused_mma")
    # Each variant at both row blocks, fp16 and fp32 once, and the benchmark's other candidates.
    candidates = sum(len(mma_candidates(*CANDIDATE_SHAPE, block)) - 1 for block in ROW_BLOCKS)
    assert len(compiled) == len(COMPILE_VARIANTS) * len(ROW_BLOCKS) + 2 + candidates, compiled
    assert candidates >= 6


def test_the_ptx_check_rejects_what_it_exists_to_catch() -> None:
    good = (
        "griddepcontrol.launch_dependents;\nld.global.v4.b32 {}, [a];\nmma.sync.aligned\ngriddepcontrol.wait;"
    )
    assert ptx_problems(good, True, torch.bfloat16) == []
    assert ptx_problems(good.replace("griddepcontrol.wait", "bar.sync"), True, torch.bfloat16) == [
        "no griddepcontrol instructions"
    ]
    assert ptx_problems(good.replace("mma.sync", "fma.rn"), True, torch.bfloat16) == [
        "no tensor-core instructions"
    ]
    assert ptx_problems(good, True, torch.float32) == ["tensor-core instructions for fp32"]
    assert ptx_problems(good.replace(".v4.b32", ".b32"), False, torch.bfloat16) == [
        "no cubin",
        "no 16-byte global loads",
    ]


# ------------------------------------------------------ GPU only: serving shapes, graphs and PDL

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# Qwen3-4B's decode layer and LM head ([N, K]; gate/up is the fused [2I, K]) with their fusions.
SERVING = {
    "qkv": (6144, 2560, Fusion(norm=QWEN3_NORM)),
    "o": (2560, 4096, Fusion(residual=True)),
    "gate-up": (19456, 2560, Fusion(norm=QWEN3_NORM, activation=GatedActivation.SILU)),
    "down": (2560, 9728, Fusion(residual=True)),
    "lm-head": (151936, 2560, Fusion()),
}


@needs_cuda
@pytest.mark.parametrize("name", list(SERVING))
def test_gpu_serving_shapes_are_invariant_within_a_row_block_and_within_the_bound(name: str) -> None:
    n, k, fusion = SERVING[name]
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(MAX_ROWS, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    nw = (1 + 0.3 * torch.randn(k, device="cuda", generator=g)).to(torch.bfloat16)
    n_out = n // 2 if fusion.activation else n
    residual = torch.randn(MAX_ROWS, n_out, device="cuda", generator=g).to(torch.bfloat16)

    def run(rows: slice) -> torch.Tensor:
        return fused_mma(
            x[rows],
            w,
            fusion,
            norm_weight=nw if fusion.norm else None,
            residual=residual[rows] if fusion.residual else None,
        )

    for block in ROW_BLOCKS:
        full = run(slice(0, block))
        smallest = 1 if block == ROW_BLOCKS[0] else ROW_BLOCKS[0] + 1
        for m in range(smallest, block):
            assert torch.equal(run(slice(0, m)), full[:m]), f"block {block}: first {m} rows"
        assert torch.equal(run(slice(block - smallest, block)), full[block - smallest :]), f"block {block}"
    full = run(slice(None))
    rows = list(range(MAX_ROWS))
    xs = reference.rms_norm(x.cpu(), QWEN3_NORM, nw.cpu()) if fusion.norm else x.cpu()
    if fusion.activation:
        # Rows whose spec norm moves under another order of the squares: the norm's own test's case.
        rows = [r for r in rows if not norm_order_flips(x[r : r + 1], QWEN3_NORM, nw)]
        want = reference.linear_gated(xs[rows], w.cpu(), fusion.activation)
        allowed = gated_allowed(xs[rows], w, fusion.activation)
    elif fusion.norm:
        want = reference.norm_linear(x.cpu(), QWEN3_NORM, nw.cpu(), w.cpu())
        allowed, _ = norm_linear_allowed(x, QWEN3_NORM, nw, w)
    else:
        want = reference.linear(xs, w.cpu())
        allowed = linear_allowed(xs, w, want)
        if fusion.residual:
            want = reference.linear_residual(xs, w.cpu(), residual.cpu())
            allowed = allowed + ulp(want, torch.bfloat16)
    # Per element only: the share of flips is printed, not held to the interpreter's figures.
    check_within(full[rows], want, allowed, share=1.0)
    print(f"{name}: {int((full[rows].cpu() != want).sum())} of {want.numel()} elements differ from the spec")


@needs_cuda
def test_gpu_graph_replay_of_a_pdl_chain_matches_eager() -> None:
    from kernels.triton.storage import pdl_supported

    assert pdl_supported(torch.device("cuda")) == (torch.cuda.get_device_capability() >= (9, 0))
    g = torch.Generator(device="cuda").manual_seed(7)
    for rows in (8, MAX_ROWS):
        hidden = torch.randn(rows, 2560, device="cuda", generator=g).to(torch.bfloat16)
        nw = torch.ones(2560, device="cuda", dtype=torch.bfloat16)
        ws = [(torch.randn(2560, 2560, device="cuda", generator=g) / 50).to(torch.bfloat16) for _ in range(6)]

        def chain(
            h: torch.Tensor = hidden, nw: torch.Tensor = nw, ws: list[torch.Tensor] = ws
        ) -> torch.Tensor:
            for first, second in zip(ws[::2], ws[1::2], strict=True):  # each reads the last one's output
                y = fused_mma(h, first, Fusion(norm=QWEN3_NORM), norm_weight=nw)
                h = fused_mma(y, second, Fusion(residual=True), residual=h)
            return h

        eager = chain()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = chain()
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, eager), rows
