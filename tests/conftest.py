"""Shared fixtures and helpers: bit-exact tree comparison, tensors of every dtype, models, file views."""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import ClassVar

import anyio
import anyio.abc
import pytest
import torch

import aiockpt

# --- Options -------------------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="also run the full stress and crash trials marked `slow` (CI runs their bounded variants)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``slow`` unless ``--run-slow`` is given."""
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="full trial marked slow: run with --run-slow (`nox -s slow`)")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


# Every dtype with a byte layout that a checkpoint must carry bit-exactly; missing ones are skipped.
DTYPE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)


def dtype_params() -> list[object]:
    """``pytest.param`` per dtype name, skipped where this torch lacks the dtype."""
    return [
        pytest.param(
            name,
            id=name,
            marks=[] if isinstance(getattr(torch, name, None), torch.dtype) else [pytest.mark.skip(name)],
        )
        for name in DTYPE_NAMES
    ]


def get_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


# --- Tensors --------------------------------------------------------------------------------------------


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A tensor of random *bit patterns* (NaNs with payloads, infs, denormals included)."""
    numel = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def zero_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """All-zero bytes, for any dtype (``torch.zeros`` lacks kernels for some float8/float4 dtypes)."""
    numel = math.prod(shape)
    return torch.zeros(numel * dtype.itemsize, dtype=torch.uint8).view(dtype).reshape(shape)


def layouts(make: Callable[[tuple[int, ...]], torch.Tensor]) -> dict[str, object]:
    """Tensors of every shape and memory layout that matters, each on its own storage."""
    return {
        "full": make((5, 7)),
        "scalar": make(()),
        "empty": make((0,)),
        "empty2d": make((3, 0)),
        "transposed": make((7, 5)).t(),
        "strided": make((6, 9))[::2, 1::3],
        "rows": make((6, 7))[2:4],
        "column": make((4, 6))[:, 1],
        "nested": {"deep": [make((2, 3)).t(), (make((3,)),)]},
    }


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The element bytes of ``t`` in logical (row-major) order, as a flat uint8 tensor."""
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8)


def tensors_in(obj: object) -> Iterator[torch.Tensor]:
    """Every tensor of a nested structure (Statefuls through their ``state_dict()``)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)
    elif isinstance(obj, aiockpt.Stateful):
        yield from tensors_in(obj.state_dict())


def snapshot(obj: object) -> object:
    """A deep copy of a state, Statefuls replaced by copies of their state dicts."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, Mapping):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(snapshot(v) for v in obj)
    if isinstance(obj, aiockpt.Stateful):
        return snapshot(obj.state_dict())
    return obj


def _tn(obj: object) -> str:
    return type(obj).__name__


def assert_tree_equal(actual: object, expected: object, path: str = "") -> None:
    """Assert that two nested structures are equal bit for bit.

    Tensors: same dtype, shape and element bytes (so NaN payloads count). Mappings: same keys in the same
    order (any Mapping type). Lists and tuples: same type. Floats: NaN equals NaN, and the sign of zero
    counts. Other values: same type and ``==``. A Stateful on the ``expected`` side stands for its
    ``state_dict()``.
    """
    where = path or "<root>"
    if not isinstance(expected, torch.Tensor) and isinstance(expected, aiockpt.Stateful):
        expected = expected.state_dict()
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        shapes = f"{tuple(actual.shape)} != {tuple(expected.shape)}"
        assert actual.shape == expected.shape, f"{where}: shape {shapes}"
        assert torch.equal(raw_bytes(actual), raw_bytes(expected)), f"{where}: tensor bytes differ"
    elif isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{where}: expected a mapping, got {type(actual).__name__}"
        assert list(actual.keys()) == list(expected.keys()), (
            f"{where}: keys {list(actual.keys())!r} != {list(expected.keys())!r}"
        )
        for k in expected:
            assert [type(a) for a in actual if a == k] == [type(k)], f"{where}: key {k!r} changed type"
            assert_tree_equal(actual[k], expected[k], f"{path}/{k}" if path else str(k))
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{where}: {_tn(actual)} != {_tn(expected)}"
        assert isinstance(actual, (list, tuple))
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_tree_equal(a, e, f"{path}/{i}" if path else str(i))
    elif isinstance(expected, float):
        assert type(actual) is float, f"{where}: expected a float, got {type(actual).__name__}"
        if math.isnan(expected):
            assert math.isnan(actual), f"{where}: {actual!r} != nan"
        else:
            assert actual == expected, f"{where}: {actual!r} != {expected!r}"
            assert math.copysign(1.0, actual) == math.copysign(1.0, expected), f"{where}: sign of zero"
    else:
        assert type(actual) is type(expected), f"{where}: {_tn(actual)} != {_tn(expected)}"
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def at(tree: object, *keys: str | int) -> object:
    """``tree[k0][k1]...`` for a nested structure typed as ``object``."""
    for k in keys:
        if isinstance(tree, Mapping):
            tree = tree[k]
        else:
            assert isinstance(tree, (list, tuple)), f"cannot index {type(tree).__name__} with {k!r}"
            assert isinstance(k, int)
            tree = tree[k]
    return tree


def tensor_at(tree: object, *keys: str | int) -> torch.Tensor:
    """Like :func:`at`, asserting that the leaf is a tensor."""
    t = at(tree, *keys)
    assert isinstance(t, torch.Tensor), f"{keys}: expected a tensor, got {type(t).__name__}"
    return t


# --- Models ---------------------------------------------------------------------------------------------


def make_model(seed: int) -> torch.nn.Sequential:
    """A small model with parameters and buffers (LayerNorm, BatchNorm running stats and counter)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        torch.nn.LayerNorm(8),
        torch.nn.BatchNorm1d(8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 2),
    )


def make_optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def make_scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)


def train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler | None,
    i: int,
) -> None:
    x, y = batch(i)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    torch.autograd.backward(loss)
    opt.step()
    if sched is not None:
        sched.step()


# --- Cancellation ---------------------------------------------------------------------------------------


async def cancelled_once(started: threading.Event, run: Callable[[], Awaitable[object]]) -> bool:
    """Await ``run()``, cancelled once ``started`` is set; return whether it was cancelled before it returned.

    However long ``run`` takes to get there (a fixed delay was sometimes too short on a loaded CI machine),
    within 30 s.
    """
    finished = False
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:

            async def cancel_when_started() -> None:
                await anyio.to_thread.run_sync(started.wait, 30, abandon_on_cancel=True)
                tg.cancel_scope.cancel()

            tg.start_soon(cancel_when_started)
            await run()
            finished = True
            tg.cancel_scope.cancel()
    return not finished


# --- Memory ---------------------------------------------------------------------------------------------


def mapping_at(address: int) -> tuple[int, str, list[str]] | None:
    """This process's mapping that holds ``address``: its start, permissions and ``VmFlags``.

    ``None`` where ``/proc/self/smaps`` cannot be read (or lists no such mapping).
    """
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    found: tuple[int, str] | None = None
    for line in lines:
        fields = line.split()
        head = fields[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            found = (start, fields[1]) if start <= address < end else None
        elif found is not None and head == "VmFlags:":
            return (*found, fields[1:])
    return None


def resident_memory(address: int, nbytes: int) -> bytes | None:
    """mincore(2) of ``nbytes`` of this process's memory from ``address`` (page-aligned), or ``None``.

    One byte per page, nonzero where the page is resident (touched); ``None`` where it cannot be told.
    """
    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    vec = ctypes.create_string_buffer(-(-nbytes // mmap.PAGESIZE))
    if mincore(address, nbytes, vec) != 0:
        return None
    return vec.raw


def assert_child_exits_cleanly(pid: int, timeout: float = 20.0) -> None:
    """Wait (boundedly) for the forked child ``pid``; it must exit with status 0, not die of a signal."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    assert os.WIFEXITED(status), f"the child died of signal {os.WTERMSIG(status)}"
    assert os.WEXITSTATUS(status) == 0


# --- File system ----------------------------------------------------------------------------------------


def evict(path: Path) -> None:
    """Write ``path``'s dirty pages to the device and evict all its pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fifo_in_place_of(path: Path) -> None:
    """Replace ``path`` with a FIFO (skips where there are none): a plain ``open`` of it waits for writers."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    os.unlink(path)
    os.mkfifo(path)


def resident_pages(path: Path) -> bytes:
    """One byte per page of ``path``, nonzero where the page cache holds it (skips where unknown)."""
    from aiockpt._pagecache import resident

    fd = os.open(path, os.O_RDONLY)
    try:
        pages = resident(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    if pages is None:
        pytest.skip("which pages are cached cannot be told here")
    return pages


def dir_tree(root: Path) -> set[str]:
    """Every file and directory under ``root``, as paths relative to it."""
    out: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            out.add(os.path.relpath(os.path.join(dirpath, name), root))
    return out


def listdir(directory: Path) -> list[str]:
    """Sorted entry names of ``directory``."""
    return sorted(os.listdir(directory))


def exists(path: Path) -> bool:
    return os.path.lexists(path)


def file_size(path: Path) -> int:
    return os.path.getsize(path)


def read_text(path: Path) -> str:
    with open(path) as f:
        return f.read()


def tmp_entries(directory: Path) -> list[str]:
    """Names of in-progress/temporary entries (``.tmp*``) in ``directory``."""
    return sorted(e.name for e in directory.iterdir() if e.name.startswith(".tmp"))


def flip_byte(path: Path, offset: int) -> None:
    """Invert every bit of the byte at ``offset`` of file ``path``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        assert len(b) == 1, f"{path} has no byte at {offset}"
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def ckpt_path(tmp_path: Path) -> Path:
    """A checkpoint directory path that does not exist yet."""
    return tmp_path / "ckpt"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A Checkpointer root that does not exist yet."""
    return tmp_path / "run"


def child_env() -> dict[str, str]:
    """The environment of a child: it imports the very aiockpt this process tests."""
    here = str(Path(aiockpt.__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}


async def stderr_of(proc: anyio.abc.Process) -> str:
    """All that ``proc`` writes to its stderr until it closes it, as text."""
    assert proc.stderr is not None
    err = b""
    with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError):
        while True:
            err += await proc.stderr.receive()
    return err.decode(errors="replace")


class Listings:
    """The root listings a Checkpointer's watches made, counted (its ``_listing`` wrapped), so that a test
    waits for the watch's next listing rather than sleeping for what should be many poll intervals."""

    _of: ClassVar[weakref.WeakKeyDictionary[aiockpt.Checkpointer, Listings]] = weakref.WeakKeyDictionary()

    def __init__(self, ckpt: aiockpt.Checkpointer) -> None:
        self.count = 0
        self._done = threading.Condition()  # for threads waiting (see wait_past)
        self._next: anyio.Event | None = None  # for a task of the watch's own loop (see past)
        real = ckpt._listing

        async def listing() -> tuple[list[int], tuple[int, int] | None] | None:
            try:
                return await real()
            finally:
                with self._done:
                    self.count += 1
                    self._done.notify_all()
                if self._next is not None:
                    self._next.set()
                    self._next = None

        ckpt._listing = listing  # type: ignore[method-assign]

    @classmethod
    def of(cls, ckpt: aiockpt.Checkpointer) -> Listings:
        """The counter of ``ckpt``'s listings, made (and ``ckpt`` wrapped) on the first call."""
        if ckpt not in cls._of:
            cls._of[ckpt] = cls(ckpt)
        return cls._of[ckpt]

    def wait_past(self, seen: int, timeout: float = 10.0) -> None:
        """Block until more than ``seen`` listings were made (for a thread other than the watch's loop)."""
        with self._done:
            assert self._done.wait_for(lambda: self.count > seen, timeout), "the watch made no listing"

    async def past(self, seen: int) -> None:
        """Wait until more than ``seen`` listings were made (in the watch's own event loop), 10 s at most."""
        with anyio.fail_after(10):
            while self.count <= seen:
                self._next = self._next or anyio.Event()
                await self._next.wait()
