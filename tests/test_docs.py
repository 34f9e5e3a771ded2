"""Every ```python block of the documentation runs, so no sample in docs/ can rot.

Each page is one test. Its python blocks run in order, in one namespace, in a fresh temporary working
directory, the way a reader would paste them into a Python session:

- a block with a top-level ``await`` (or ``async with``/``async for``) is compiled with
  ``PyCF_ALLOW_TOP_LEVEL_AWAIT`` and awaited on the test's event loop, as in ``python -m asyncio``;
- a block without one runs in a worker thread, outside any event loop, as a plain script does (the
  module-level ``aiockpt.sync`` functions refuse to run inside a running loop, on purpose).

A block is skipped only when the line directly above its opening fence is ``<!-- no-run -->`` (samples
that need torchrun or several processes); it is still compiled, so it must be valid Python. Failures
name the page and the line of the block's fence; tracebacks point at the page's own line numbers.

Pages that need a fixture (a server, credentials) get one from :data:`PAGE_SETUP`.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import contextlib
import inspect
import re
import traceback
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from types import CodeType

import pytest

from s3_util import s3_server

DOCS = Path(__file__).resolve().parents[1] / "docs"
NO_RUN = "<!-- no-run -->"
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")

PageSetup = Callable[[Path, pytest.MonkeyPatch], AbstractAsyncContextManager[Mapping[str, object]]]
"""Given the page's working directory and the test's monkeypatch (environment variables set through it
are restored after the page), an async context manager that prepares what the page needs for the
duration of its test and yields extra names for the page's namespace."""


@contextlib.asynccontextmanager
async def _s3_page(workdir: Path, mp: pytest.MonkeyPatch) -> AsyncIterator[Mapping[str, object]]:
    """A moto S3 server on 127.0.0.1 with the bucket ``aiockpt-docs`` and the AWS variables set."""
    with s3_server() as server, server.env():
        server.bucket("aiockpt-docs")
        yield {}


# Page (path relative to docs/, POSIX separators) -> its setup hook. A page without one gets nothing.
PAGE_SETUP: dict[str, PageSetup] = {"object-storage.md": _s3_page}


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    run: bool


def parse_blocks(text: str) -> list[Block]:
    """Every fenced block of a Markdown page, with its language and whether it is marked no-run.

    Indented fences (inside list items or admonitions) are recognised; their indentation is removed from
    the block's lines.

    Raises:
        ValueError: A fence is never closed.
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        info = opening["info"].strip()
        lang = info.split()[0].lower() if info else ""
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            closing = _FENCE.match(lines[i])
            if (
                closing is not None
                and not closing["info"].strip()
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
            ):
                break
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            i += 1
        else:
            raise ValueError(f"the code block opened at line {start + 1} is never closed")
        marked = start > 0 and lines[start - 1].strip() == NO_RUN
        blocks.append(Block(line=start + 1, lang=lang, code="\n".join(body) + "\n", run=not marked))
        i += 1
    return blocks


def compile_block(block: Block, page: Path) -> CodeType:
    """Compile a python block so that its line numbers are the page's own."""
    # The first code line sits just below the fence: pad so tracebacks name the page's line numbers.
    source = "\n" * block.line + block.code
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    code: CodeType = compile(source, str(page), "exec", flags=flags, dont_inherit=True)
    return code


async def run_page(page: Path, name: str, namespace: dict[str, object]) -> int:
    """Run the python blocks of ``page`` (called ``name`` in messages) in order in ``namespace``.

    Returns:
        How many blocks ran.

    Raises:
        pytest.fail.Exception: A block failed; the message names the page and the block's line.
    """
    ran = 0
    for block in parse_blocks(page.read_text(encoding="utf-8")):
        if block.lang != "python":
            continue
        try:
            code = compile_block(block, page)  # no-run blocks must at least be valid Python
            if not block.run:
                continue
            if code.co_flags & inspect.CO_COROUTINE:
                result = eval(code, namespace)
                assert inspect.iscoroutine(result)
                await result
            else:
                await asyncio.to_thread(eval, code, namespace)
        except (Exception, SystemExit):
            failure = traceback.format_exc()
        else:
            ran += 1
            continue
        # Outside the except clause, so the report is the block's own traceback, not a chain.
        pytest.fail(f"{name}: the python block at line {block.line} failed:\n{failure}", pytrace=False)
    return ran


@contextlib.asynccontextmanager
async def no_setup(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Mapping[str, object]]:
    yield {}


def pages() -> list[str]:
    return sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))


def test_there_are_pages_to_test() -> None:
    assert {"index.md", "quickstart.md", "format.md", "design.md"} <= set(pages())


@pytest.mark.parametrize("name", pages())
async def test_page(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = DOCS / name
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    setup = PAGE_SETUP.get(name, no_setup)
    async with setup(workdir, monkeypatch) as extra:
        namespace: dict[str, object] = {"__name__": "__main__", "__builtins__": builtins, **extra}
        ran = await run_page(page, f"docs/{name}", namespace)
    blocks = [b for b in parse_blocks(page.read_text(encoding="utf-8")) if b.lang == "python"]
    assert ran == sum(b.run for b in blocks)


# --- The harness itself ---------------------------------------------------------------------------------

SAMPLE = """\
# A page

```python
x = 1
```

<!-- no-run -->
```python
raise SystemExit("never")
```

- a list item:

    ```python
    y = x + 1
    ```

```bash
echo not python
```

````text
```python
not a block of its own
```
````
"""


def test_parse_blocks_finds_languages_lines_markers_and_indented_fences() -> None:
    blocks = parse_blocks(SAMPLE)
    assert [(b.line, b.lang, b.run) for b in blocks] == [
        (3, "python", True),
        (8, "python", False),
        (14, "python", True),
        (18, "bash", True),
        (22, "text", True),
    ]
    assert blocks[2].code == "y = x + 1\n"
    assert "```python" in blocks[4].code


def test_parse_blocks_refuses_an_unclosed_fence() -> None:
    with pytest.raises(ValueError, match="line 2"):
        parse_blocks("text\n```python\nx = 1\n")


async def test_run_page_shares_one_namespace_awaits_and_skips_no_run(tmp_path: Path) -> None:
    page = tmp_path / "sample.md"
    page.write_text(SAMPLE + "\n```python\nimport asyncio\nawait asyncio.sleep(0)\nz = y * 10\n```\n")
    namespace: dict[str, object] = {"__builtins__": builtins}
    assert await run_page(page, "sample.md", namespace) == 3
    assert namespace["z"] == 20


async def test_blocks_without_await_run_outside_the_event_loop(tmp_path: Path) -> None:
    page = tmp_path / "sync.md"
    page.write_text(
        "```python\nimport asyncio\ntry:\n    asyncio.get_running_loop()\n    inside = True\n"
        "except RuntimeError:\n    inside = False\n```\n\n"
        "```python\nawait asyncio.sleep(0)\nlater = asyncio.get_running_loop() is not None\n```\n"
    )
    namespace: dict[str, object] = {"__builtins__": builtins}
    await run_page(page, "sync.md", namespace)
    assert namespace["inside"] is False
    assert namespace["later"] is True


async def test_a_no_run_block_must_still_be_valid_python(tmp_path: Path) -> None:
    page = tmp_path / "typo.md"
    page.write_text("<!-- no-run -->\n```python\nimport torch.distributed as dist\ndist.init(\n```\n")
    with pytest.raises(pytest.fail.Exception, match=r"typo\.md: the python block at line 2 failed"):
        await run_page(page, "typo.md", {"__builtins__": builtins})


async def test_a_failing_block_is_reported_with_its_page_and_line(tmp_path: Path) -> None:
    page = tmp_path / "bad.md"
    page.write_text("# Bad\n\n```python\nok = True\n```\n\n```python\nawait undefined_name()\n```\n")
    with pytest.raises(pytest.fail.Exception) as caught:
        await run_page(page, "docs/bad.md", {"__builtins__": builtins})
    message = str(caught.value)
    assert "docs/bad.md: the python block at line 7 failed" in message
    assert f'File "{page}", line 8' in message  # the traceback names the page's own line
    assert "NameError" in message
