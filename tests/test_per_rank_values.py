"""What counts as differing between ranks (per-rank state): values Python finds equal, signed zeros, NaNs,
ties, checksum collisions. Each test failed on the first per-rank code (18b2ea6..7814610).

The distributed ones spawn real gloo ranks (``distributed_util.run_world``); the collective-free ones
that need no collective write each rank's part with a single-process save into its part directory, as
``use_collectives=False`` names it (as test_load's collective-free tests do).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
import torch.distributed as dist

import aiockpt

from distributed_util import run_world

pytestmark = pytest.mark.timeout(120)


def _same(a: object, b: object) -> bool:
    """Bit-exact equality of two read trees: types, float signs and NaNs included."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is float and type(b) is float:
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return type(a) is type(b) and a == b


async def _save_and_read(
    rank: int, world: int, path: str, states: list[dict[str, Any]], kw: dict[str, Any]
) -> str:
    """Save ``states[rank]`` on every rank, then read it back as this rank: ``""`` or what differs."""
    await aiockpt.save(states[rank], path, **kw)
    dist.barrier()  # (every part published, for use_collectives=False)
    got = await aiockpt.read(path)
    return "" if _same(got, states[rank]) else f"rank {rank} read {got!r}, saved {states[rank]!r}"


_MODES = [pytest.param({}, id="collective"), pytest.param({"use_collectives": False}, id="collective-free")]


# --- Collective-free parts: values Python finds equal (1 == 1.0 == True) are each rank's ------------------


@pytest.mark.parametrize(("v0", "v1"), [(1, True), (1, 1.0), (0, False), (0.0, -0.0)])
async def test_collective_free_parts_keep_a_value_python_finds_equal_to_rank_0s(
    tmp_path: Path, v0: object, v1: object
) -> None:
    # docs/distributed.md: "plain values (`1` and `1.0` differ)". merge_parts' shortcut compared the
    # parts' trees with ==, which msgspec answers field by field with Python's ==: the trees "agreed",
    # the merge was rank 0's tree, and rank 1 read rank 0's 1 for its True (or 1.0, or -0.0).
    step = tmp_path / "step"
    for rank, value in enumerate((v0, v1)):
        await aiockpt.save({"w": torch.ones(3), "x": value}, step / f"rank-{rank:05d}-of-00002")
    for rank, value in enumerate((v0, v1)):
        got = (await aiockpt.read(step, rank=rank))["x"]
        assert _same(got, value), (rank, got, value)


@pytest.mark.dist
def test_collective_free_save_keeps_each_ranks_bool_against_rank_0s_int(tmp_path: Path) -> None:
    # The same through a real 2-rank use_collectives=False save: rank 1's True came back as 1.
    states = [{"w": torch.ones(3), "done": 1}, {"w": torch.ones(3), "done": True}]
    path = str(tmp_path / "ckpt")
    kw = {"use_collectives": False}
    assert run_world(_save_and_read, 2, tmp_path, path, states, kw, timeout=60) == ["", ""]


# --- A tensor rank 0 ties to a key only it holds -----------------------------------------------------------


@pytest.mark.dist
def test_a_shared_tensor_rank_0_also_holds_under_a_key_of_its_own_saves(tmp_path: Path) -> None:
    # Rank 0 alone keeps a second reference to a model tensor (``extra/w_ref``). The merge makes
    # ``extra`` rank 0's per-rank state, so rank 0's tensor becomes "its own" entry, unregistered by key
    # path in the global plan; rank 1's ``model/w`` (shared) then found no entry and every rank's save
    # failed with "rank 1 holds tensor 'model/w', which rank 0's state lacks" (rank 0 holds it).
    w = torch.arange(4.0)
    states = [{"model": {"w": w}, "extra": {"w_ref": w}}, {"model": {"w": torch.arange(4.0)}}]
    path = str(tmp_path / "ckpt")
    assert run_world(_save_and_read, 2, tmp_path, path, states, {}, timeout=60) == ["", ""]


@pytest.mark.dist
def test_a_tie_listed_in_another_order_on_another_rank_saves(tmp_path: Path) -> None:
    # One tensor under two keys, the keys in another order on rank 1 (its first key is another), and a
    # position per rank: the trees were exchanged, and the global plan, which found rank 1's tensor by
    # its first key, refused it ("rank 1 holds tensor 'b', which rank 0's state lacks").
    w = torch.arange(4.0)
    states = [{"a": w, "b": w, "pos": 0}, {"b": w, "a": w, "pos": 1}]
    path = str(tmp_path / "ckpt")
    assert run_world(_save_and_read, 2, tmp_path, path, states, {}, timeout=60) == ["", ""]


# --- Floats by their bits: -0.0 is not 0.0, and a NaN is itself --------------------------------------------


@pytest.mark.dist
@pytest.mark.parametrize("kw", _MODES)
def test_negative_zero_of_one_rank_is_not_taken_for_rank_0s_zero(tmp_path: Path, kw: dict[str, Any]) -> None:
    # The digests differ (the bytes do), but the merge's ``alike`` compared ValueNodes with ==:
    # 0.0 == -0.0, so rank 1's -0.0 was merged into the shared value and read back as rank 0's 0.0.
    states = [{"w": torch.ones(3), "x": 0.0, "pos": 0}, {"w": torch.ones(3), "x": -0.0, "pos": 1}]
    path = str(tmp_path / "ckpt")
    assert run_world(_save_and_read, 2, tmp_path, path, states, kw, timeout=60) == ["", ""]


@pytest.mark.dist
@pytest.mark.parametrize("kw", _MODES)
def test_nan_every_rank_saved_is_shared_state(tmp_path: Path, kw: dict[str, Any]) -> None:
    # Every rank saves the same NaN (besides a position of its own). nan != nan, so the merge made each
    # NaN per-rank state: a rank outside the saving world (a job resumed with more ranks) then lacked
    # ``best`` and could not read the checkpoint at all (StateError at the list item ``hist/0``), though
    # no rank's value differed there.
    from aiockpt._format import RanksNode
    from aiockpt._load import read_manifest

    states = [{"w": torch.ones(3), "best": math.nan, "hist": [math.nan, 0.5], "pos": r} for r in range(2)]
    path = tmp_path / "ckpt"
    assert run_world(_save_and_read, 2, tmp_path, str(path), states, kw, timeout=60) == ["", ""]
    got = aiockpt.sync.read(path, rank=2)  # a third rank of a resumed job: the state every rank shared
    assert _same(got, {"w": torch.ones(3), "best": math.nan, "hist": [math.nan, 0.5]})
    tree = read_manifest(path).tree
    per_rank = {k for k, v in zip(tree.keys, tree.values, strict=True) if isinstance(v, RanksNode)}
    assert per_rank == {"pos"}


# --- Small tensors compared by 64 bits: a CRC32C collision does not lose a rank's value --------------------

# Two 8-byte values with the same CRC32C (found by a birthday search: 2^16 tries).
_COLLIDING = (bytes.fromhex("08e7a054aeab2aa2"), bytes.fromhex("8d0c330ee85ab2e3"))


@pytest.mark.dist
def test_small_per_rank_tensors_whose_crc32c_collide_stay_each_ranks(tmp_path: Path) -> None:
    # docs/distributed.md: a plain tensor of up to 64 KiB is compared by its bytes. It was compared by
    # its CRC32C alone (Signature.crc), and the 64-bit BLAKE2b digest hashed that CRC, not the bytes, so
    # it agreed too: two different seeds whose CRC32C agree were taken as one shared tensor and rank 0
    # read rank 1's (the least-loaded holder, which wrote it). 1 in 2^32 per differing tensor.
    # (Collective-free parts are compared by their chunks' checksums, so only the collective save here.)
    assert _COLLIDING[0] != _COLLIDING[1]
    assert crc32c.crc32c(_COLLIDING[0]) == crc32c.crc32c(_COLLIDING[1])
    states = [
        {"w": torch.ones(3), "seed": torch.frombuffer(bytearray(raw), dtype=torch.uint8)}
        for raw in _COLLIDING
    ]
    path = str(tmp_path / "ckpt")
    assert run_world(_save_and_read, 2, tmp_path, path, states, {}, timeout=60) == ["", ""]
