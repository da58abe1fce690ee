"""What the LoRA kernels compile to on an H200 (sm_90 PTX, compiled here by Triton without a GPU,
``harness/ptx.py``): the fast path's and the fused down GEMM's loads of weights and ranks are vector loads,
and the wide down GEMM, at the tile ``=fast`` places for each shape, fits a Hopper program's shared memory.

Under a mask Triton cannot prove constant over aligned runs, a load along a contiguous axis is one load
per element. The LoRA B buffers hold ranks innermost and each adapter's rank is read from memory, so an
exact ``offs_r < rank`` mask made every B load of the expand a 16-bit load (32 of them a thread for a
64 x 128 tile), the expand 4-5x its floor on the H200 at decode sizes. The configurations with exact
masks are the controls: they show that the check sees the difference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VECTOR = ("expand, one rank tile", "expand, rank tiles of 16", "shrink", "one kernel a hook",
          "fused down GEMM",
          # as =fast launches it (fused_lora.WIDE_TILES); compiling it at all is half of this test: Triton's
          # interpreter, which runs every other test, accepts kernels its compiler rejects
          "wide fused down GEMM, rank 16", "wide fused down GEMM, rank 64", "wide fused down GEMM, K loop",
          "wide fused down GEMM, rank 32, B tiles ahead", "wide fused down GEMM, rank 64, B tiles ahead",
          "wide fused down GEMM, rank 32, B tiles pipelined", "wide fused down GEMM, rank 64, A once",
          "wide fused down GEMM, rank 64, A once, three stages", "wide fused down GEMM, rank 64, A once, B tiles as loaded",
          "expand and activation", "expand and activation, block by block, rows a tile ahead")
CONTROLS = ("expand, one rank tile, exact rank masks", "expand, rank tiles of 16, exact rank masks",
            "fused down GEMM, exact rank masks")


def compile_sm90(names) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "harness.ptx", *names], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def accesses():
    return {name: built["accesses"] for name, built in compile_sm90([*VECTOR, *CONTROLS]).items()}


@pytest.fixture(scope="module")
def placed():
    from harness.ptx import CONFIGURATIONS

    return compile_sm90([name for name in CONFIGURATIONS if name.startswith("fused down GEMM placed")])


def element_loads(counts: dict[str, int]) -> int:
    """Global loads of one 16-bit element."""
    return sum(n for access, n in counts.items() if access.startswith("ld.global") and access.endswith("16"))


@pytest.mark.parametrize("name", VECTOR)
def test_lora_kernels_load_in_vectors(accesses, name):
    counts = accesses[name]
    assert element_loads(counts) == 0, counts
    # B and x / A arrive in 16-byte copies of the software pipeline or 16-byte loads.
    assert counts.get("cp.async.cg.shared.global", 0) + counts.get("ld.global.v4.b32", 0) >= 2, counts


@pytest.mark.parametrize("name", CONTROLS)
def test_exact_rank_masks_load_element_by_element(accesses, name):
    assert element_loads(accesses[name]) >= 16, accesses[name]


def test_b_tiles_feeding_unconditional_gemms_are_copied_a_column_tile_ahead(accesses):
    """``LORA_AHEAD=3``: the wide kernel's two B tiles a column tile (rank 32 x 128 columns, bf16: 4 16-byte pieces
    a thread each) feed GEMMs under no branch, so Triton software-pipelines them with the column loop: they leave the
    loads the epilogue waits for (``ld.global.v4``) for copies into shared memory issued a column tile ahead
    (``cp.async``, in the loop and its prologue); under ``LORA_AHEAD=1``'s branches they stay loads."""
    ahead = accesses["wide fused down GEMM, rank 32, B tiles ahead"]
    pipelined = accesses["wide fused down GEMM, rank 32, B tiles pipelined"]
    pieces = 2 * (32 * 128 * 2 // 16 // 128)
    assert pipelined["ld.global.v4.b32"] <= ahead["ld.global.v4.b32"] - pieces, (ahead, pipelined)
    assert pipelined["cp.async.cg.shared.global"] >= ahead["cp.async.cg.shared.global"] + 2 * pieces, (ahead, pipelined)


def test_a_tiles_read_once_leave_the_column_loops_pipeline():
    """``A_ONCE``: the block's two K tiles of A (64 x 128 fp8 each) read once before the column loop instead of
    copied again in each pipeline stage of it: 16,384 bytes less shared memory a program at two stages, and each
    column tile's copies only the weights' (4 16-byte pieces a thread of an A tile fewer, in the loop and its
    prologue). The rank-64 tile as placed, and with its A once."""
    built = compile_sm90(["wide fused down GEMM, rank 64", "wide fused down GEMM, rank 64, A once"])
    again, once = built["wide fused down GEMM, rank 64"], built["wide fused down GEMM, rank 64, A once"]
    assert once["shared_bytes"] <= again["shared_bytes"] - 2 * 64 * 128, (again, once)
    pieces = 2 * (64 * 128 // 16 // 128)  # two K tiles of A
    copies = "cp.async.cg.shared.global"
    assert once["accesses"][copies] <= again["accesses"][copies] - 2 * pieces, (again, once)


def test_two_stages_keep_no_copy_in_flight_while_a_column_tile_computes_three_do_at_two_programs_an_sm():
    """The wide kernel's column loop at two stages (the rank-64 tile as placed): Triton issues a column tile's copies
    after the tile before is stored and waits for every one of them first thing in the next (``async_wait`` leaving
    0 groups), so a program has nothing in flight while it computes; only the SM's other program hides the latency.
    At three stages the wait leaves the next tile's copy groups in flight; reading its A tiles once (``A_ONCE``),
    the 32-wide tile does so within half a Hopper SM's shared memory, its registers within half the SM's (two
    programs an SM, as the tile placed)."""
    from harness.ptx import HOPPER_SHARED_BYTES

    names = ["wide fused down GEMM, rank 64", "wide fused down GEMM, rank 64, A once, three stages"]
    built = compile_sm90(names)
    placed, three = built[names[0]], built[names[1]]
    assert placed["copies_left_in_flight"][0] == 0 and max(placed["copies_left_in_flight"][:-1]) == 0, placed
    assert three["copies_left_in_flight"][0] > 0, three  # the loop's wait; the last, after it, drains
    reserved = 1024  # a program's shared memory the driver keeps (sm_90)
    for tile in (placed, three):
        assert tile["shared_bytes"] + reserved <= (HOPPER_SHARED_BYTES + reserved) // 2, tile
        assert tile["registers"] * 128 * 2 <= 65536, tile


def test_b_tiles_as_loaded_skip_the_trip_through_registers_and_keep_two_programs_an_sm():
    """``RANKS_IN_GRANULES``: without the ``tl.where`` past each rank the two pipelined B tiles go from their copies
    to the GEMMs, not through registers and back: the rank-64 tile reading its A tiles once takes fewer registers
    than as placed (179 against 238 with Triton 3.6, 220 with 3.8) and still fits two programs an SM (its B tiles
    then double-buffered: 114,688 bytes, the placed tile's)."""
    from harness.ptx import HOPPER_SHARED_BYTES

    names = ["wide fused down GEMM, rank 64", "wide fused down GEMM, rank 64, A once, B tiles as loaded"]
    built = compile_sm90(names)
    placed, loaded = built[names[0]], built[names[1]]
    assert loaded["registers"] <= placed["registers"] - 16, (placed, loaded)
    assert loaded["shared_bytes"] + 1024 <= (HOPPER_SHARED_BYTES + 1024) // 2, loaded


def test_the_k_loop_is_a_software_pipeline_where_six_k_tiles_unrolled_in_one_stage_are_none():
    """At six K tiles (Qwen3-30B-A3B tp1's down GEMM) two stages of the unrolled steps do not fit a Hopper program;
    in one stage nothing is in flight while a tile computes (no cp.async at all; 0.72 ms against the K loop's 0.50
    on an H100 at 8192 tokens). The K loop's stages are copies in flight."""
    built = compile_sm90(["wide fused down GEMM, K loop", "wide fused down GEMM, K unrolled in one stage"])
    looped = built["wide fused down GEMM, K loop"]["accesses"]
    unrolled = built["wide fused down GEMM, K unrolled in one stage"]["accesses"]
    assert unrolled.get("cp.async.cg.shared.global", 0) == 0, unrolled
    assert looped.get("cp.async.cg.shared.global", 0) >= 16, looped


def test_the_fused_down_gemm_as_placed_fits_a_hoppers_shared_memory(placed):
    """A kernel that asks a program for more shared memory than the GPU has compiles, and fails at its launch
    (Triton's OutOfResources): the first fused launch on Qwen3-30B-A3B-FP8's down GEMM did, in a server. Where two
    pipeline stages of the wide kernel's column loop would not fit (six K tiles: 303,104 bytes with SGLang's
    BLOCK_SIZE_M of 64), ``fused_lora.wide_tile`` runs the K steps as the pipelined loop, a stage one K tile; the
    estimate it decides by is at least what Triton allocates, over block-fp8 experts and over bf16 ones (4 KB short of
    it at K 256, rank 16). As placed: the wide kernel unrolled at two K tiles, its K loop at three up to rank 16, the
    narrow kernel (one column tile a program, SGLang's pipeline) at Qwen3-30B-A3B tp 1's six; with fewer stages where
    SGLang's tile leaves no room for the epilogue (its bf16 128 x 256 tile of four stages: 262,144 bytes at rank 64,
    the launch refused on an H100; ``fused_lora.narrow_tile``)."""
    from harness.ptx import HOPPER_SHARED_BYTES

    assert len(placed) >= 16
    kinds = set()
    for name, built in placed.items():
        assert built["shared_bytes"] <= built["estimate"], (name, built["shared_bytes"], built["estimate"])
        assert built["shared_bytes"] <= HOPPER_SHARED_BYTES, (name, built["shared_bytes"], built["tile"])
        assert built["tile"]["num_stages"] >= 2, (name, built["tile"])  # a pipeline everywhere
        kinds.add("narrow" if not built["n_tiles"] else "K loop" if built["tile"].get("K_LOOP") else "unrolled")
    assert kinds == {"narrow", "K loop", "unrolled"}
