"""Reading a ``torch.save`` file of a state dict (with ``weights_only=True`` unless pickle is allowed)."""

from __future__ import annotations

import io
import mmap
import pickle
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch

from .._errors import FormatError, StateError, StorageError
from .._format import Chunk, Key, KeyPath, Manifest, TensorEntry
from .._memory import nbytes_of
from .._tree import dtype_name, flatten, render, type_name
from ._source import DecodingSource

# A torch.save file is a zip archive, or (legacy format) a pickle opening with torch's magic number.
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"


def is_torch_file(path: Path) -> bool:
    """Whether the regular file ``path`` starts like a ``torch.save`` file. Blocking."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(_LEGACY_MAGIC))
    except OSError:
        return False
    return head.startswith(_ZIP_MAGIC) or head == _LEGACY_MAGIC


def _compressed(path: Path) -> bool:
    """Whether the zip archive ``path`` holds a compressed record (``torch.save`` stores them all). Blocking.

    ``False`` for anything else (a legacy file, an unreadable archive): ``torch.load`` reports those.
    """
    try:
        with zipfile.ZipFile(path) as zf:
            return any(info.compress_type != zipfile.ZIP_STORED for info in zf.infolist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def load_file(path: Path, *, allow_pickle: bool) -> object:
    """``torch.load`` of ``path`` onto the CPU, memory-mapped where the file allows it. Blocking.

    Raises:
        StateError: The file holds objects ``weights_only`` refuses and ``allow_pickle`` is false.
        FormatError: The file is not a ``torch.save`` file.
        StorageError: It cannot be read.
    """
    try:
        if _compressed(path):
            # torch.load(mmap=True) would map a compressed record's bytes as the tensor's, unchecked.
            return torch.load(path, map_location="cpu", weights_only=not allow_pickle)
        try:
            return torch.load(path, map_location="cpu", weights_only=not allow_pickle, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            # The legacy (pre-zip) serialization cannot be memory-mapped.
            return torch.load(path, map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as exc:
        if allow_pickle:
            raise FormatError(f"{path} is not a readable torch.save file: {exc}", file=str(path)) from exc
        raise _refused(path, str(exc)) from exc
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc.strerror or exc}", path=str(path)) from exc
    except Exception as exc:
        raise FormatError(f"{path} is not a readable torch.save file: {exc}", file=str(path)) from exc


# torch.load(weights_only=True) wraps its unpickler's one-line reason in paragraphs of advice, some in ANSI
# bold. The reason names the global it stopped at ("Unsupported global: GLOBAL numpy.x.y was not an
# allowed global by default", "... GLOBAL posix.system whose module posix is blocked") or, for other
# refusals, follows "WeightsUnpickler error:" or "Weights only load failed.".
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_REFUSED_GLOBAL = re.compile(r"GLOBAL (\S+) (?:was not an allowed global|whose module \S+ is blocked)")
_CAUSE = "WeightsUnpickler error:"
_FAILED = "Weights only load failed."
# Lines of torch's advice, never the reason itself.
_ADVICE = (
    "This file can still be loaded",
    "(1)",
    "(2)",
    "In PyTorch",
    "Please file an issue",
    "Check the doc",
)
_MAX_REASON = 300
# data.pkl holds only the structure (a few hundred bytes per tensor): a larger one is not walked.
_MAX_PICKLE = 1 << 28


def _reason(message: str) -> tuple[str | None, str]:
    """The global ``torch.load`` refused (``None`` if another rule), and its reason as one clean line."""
    text = _ANSI.sub("", message)
    m = _REFUSED_GLOBAL.search(text)
    if m is not None:
        blocked = "whose module" in m.group(0)
        return m.group(1), f"{m.group(1)} is {'of a blocked module' if blocked else 'not an allowed global'}"
    if _CAUSE in text:
        text = text.rsplit(_CAUSE, 1)[1]
    for line in text.splitlines():
        line = line.strip().removeprefix(_FAILED).strip()
        if line and not line.startswith(_ADVICE):
            return None, line if len(line) <= _MAX_REASON else line[: _MAX_REASON - 3] + "..."
    return None, "torch.load gave no reason"


def _refused(path: Path, message: str) -> StateError:
    """The error for a file ``torch.load(weights_only=True)`` refused with ``message``: one line.

    It names the file, the global refused (or torch's reason) and, where the file's pickle can be walked
    (:func:`_holders`), the keys of the values that need that global.
    """
    name, reason = _reason(message)
    paths = _holders(path, name) if name is not None else []
    keys = [render(p) for p in paths]
    if not keys:
        what = "objects"
    elif len(keys) == 1:
        what = f"an object at key {keys[0]!r}"
    else:
        shown = ", ".join(repr(k) for k in keys[:5])
        what = f"objects at keys {shown}" + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
    return StateError(
        f"{path} holds {what} that torch.load(weights_only=True) refuses ({reason}; unpickling it can run "
        "code): pass allow_pickle=True (--allow-pickle on the command line) if you trust this file",
        key=keys[0] if keys else None,
    )


class _Stub:
    """What a global of a pickle stands for while :func:`_holders` walks it: a record, never a call.

    Every global resolves to a subclass named after it; calling one (REDUCE, NEWOBJ, INST) makes an
    instance keeping the arguments, and what the pickle then hands it (state, items, appended values) is
    kept too, under the key or index it came with, so the walk can descend through it.
    """

    name = ""
    parts: list[tuple[Key | None, object]]  # (key or index, value); None: an argument or state
    appended: int

    def __new__(cls, *args: object, **kwargs: object) -> _Stub:
        self = super().__new__(cls)
        self.parts = [(None, a) for a in (*args, *kwargs.values())]
        self.appended = 0
        return self

    def __call__(self, *args: object, **kwargs: object) -> _Stub:
        return type(self)(*args, **kwargs)

    def __setstate__(self, state: object) -> None:
        self.parts.append((None, state))

    def __setitem__(self, key: object, value: object) -> None:
        self.parts.append((_key(key), value))

    def append(self, value: object) -> None:
        self.parts.append((self.appended, value))
        self.appended += 1

    def extend(self, values: list[object]) -> None:
        for v in values:
            self.append(v)


def _key(key: object) -> Key:
    return key if type(key) in (str, int) else repr(key)  # type: ignore[return-value]


class _StubUnpickler(pickle.Unpickler):
    """Unpickles anything without importing or calling any of it: every global becomes a :class:`_Stub`."""

    def __init__(self, file: io.BytesIO | mmap.mmap) -> None:
        super().__init__(file)
        self.stubs: dict[str, type[_Stub]] = {}

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full not in self.stubs:
            self.stubs[full] = cast("type[_Stub]", type("_Global", (_Stub,), {"name": full}))
        return self.stubs[full]

    def persistent_load(self, pid: Any) -> Any:
        return _Stub()  # a tensor's storage


def _structure(path: Path) -> object:
    """The structure of the ``torch.save`` file ``path`` as :class:`_StubUnpickler` makes it. Blocking.

    Only the pickle is read, never the tensor data: a zip archive's ``data.pkl``, or the fourth pickle of a
    legacy file (after its magic number, protocol version and system info).

    Raises:
        Exception: Anything, for a file that cannot be walked so.
    """
    with open(path, "rb") as f:
        if f.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                for _ in range(3):
                    _StubUnpickler(m).load()
                return _StubUnpickler(m).load()
    with zipfile.ZipFile(path) as zf:
        (info,) = [
            i for i in zf.infolist() if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1
        ]
        if info.file_size > _MAX_PICKLE:
            raise ValueError(f"data.pkl of {info.file_size} bytes")
        return _StubUnpickler(io.BytesIO(zf.read(info))).load()


def _holders(path: Path, name: str) -> list[KeyPath]:
    """The key paths of the values of the ``torch.save`` file ``path`` that need the global ``name``.

    In pickle order: the first is where ``torch.load`` stopped. Found by walking the file's structure as
    :class:`_StubUnpickler` makes it (:func:`_structure`), which runs no code of the file. Best effort and
    blocking: empty for a file that cannot be walked.
    """
    # torch names builtins without their module ("set" for builtins.set).
    wanted = {name, f"builtins.{name}"}
    try:
        root = _structure(path)
    except Exception:  # a damaged or foreign file: only the keys go unnamed
        return []
    found: list[KeyPath] = []
    seen: set[int] = set()
    stack: list[tuple[object, KeyPath]] = [(root, ())]
    while stack:  # depth first, in pickle order, without recursion (a pickle may nest deeply)
        obj, at = stack.pop()
        if isinstance(obj, type) and issubclass(obj, _Stub):
            if obj.name in wanted:
                found.append(at)
            continue
        if id(obj) in seen:
            continue
        children: list[tuple[object, KeyPath]] = []
        if isinstance(obj, _Stub):
            seen.add(id(obj))
            if type(obj).name in wanted:
                found.append(at)
                continue
            children = [(v, at if k is None else (*at, k)) for k, v in obj.parts]
        elif isinstance(obj, dict):
            seen.add(id(obj))
            children = [(v, (*at, _key(k))) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple)):
            seen.add(id(obj))
            children = [(v, (*at, i)) for i, v in enumerate(obj)]
        stack.extend(reversed(children))
    return found


class TorchFileSource(DecodingSource):
    """A ``torch.save`` file of a mapping; matched like a native checkpoint (by nested keys)."""

    def __init__(self, path: Path, *, allow_pickle: bool) -> None:
        self.location = path.parent
        obj = load_file(path, allow_pickle=allow_pickle)
        if not isinstance(obj, Mapping):
            raise FormatError(
                f"{path} holds a {type_name(obj)}, not a state dict (a mapping)", file=str(path)
            )
        flat = flatten(obj, allow_pickle=True)
        self.tensors = flat.tensors
        entries = []
        for t, key in zip(flat.tensors, flat.paths, strict=True):
            shape = tuple(t.shape)
            chunk = Chunk(
                offsets=(0,) * len(shape),
                sizes=shape,
                file=path.name,
                offset=0,
                nbytes=nbytes_of(t),
                checksums=(),
            )
            entries.append(TensorEntry(path=key, dtype=dtype_name(t.dtype), shape=shape, chunks=(chunk,)))
        self.manifest = Manifest(
            checksum_algorithm="none",
            checksum_block=1 << 62,
            tree=flat.tree,
            tensors=tuple(entries),
            files=(),
            library_version="torch.save",
        )

    def chunk(self, index: int, number: int) -> torch.Tensor:
        return self.tensors[index]

    def close(self) -> None:
        self.tensors = []
