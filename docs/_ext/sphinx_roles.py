"""A Griffe extension that turns the Sphinx roles of aiockpt's docstrings into Markdown for mkdocstrings.

The docstrings are Google style but use two pieces of reStructuredText that Markdown would show verbatim.
Before a docstring is parsed:

- each Sphinx role (``:class:`SaveHandle```, ``:meth:`aclose```) becomes a cross-reference when its
  target is rendered in the API reference (a public name of ``aiockpt`` or ``aiockpt.sync``, or a public
  method or property of one), and inline code otherwise (internals, data attributes): a link is only
  made where mkdocs ``--strict`` can resolve it;
- a literal block introduced by ``::`` (``Example::`` and an indented sample) becomes a fenced Python
  block.

Used by ``mkdocs.yml`` (``plugins: mkdocstrings: handlers: python: options: extensions``).
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|meth|func|attr|data|exc|obj|mod):`(?P<target>[^`]+)`")


def _public(path: str) -> bool:
    """Whether ``path`` (``aiockpt.X``, ``aiockpt.X.member``, ``aiockpt.sync.X``) is rendered.

    That is: every step is public and in its module's ``__all__``, and a final class member is a
    method, a property or a class (data attributes have no entry of their own).
    """
    parts = path.split(".")
    if parts[0] != "aiockpt" or any(p.startswith("_") for p in parts):
        return False
    obj: Any = importlib.import_module("aiockpt")
    for i, part in enumerate(parts[1:], start=1):
        if inspect.ismodule(obj):
            if part not in getattr(obj, "__all__", ()):
                return False
            obj = getattr(obj, part)
        elif inspect.isclass(obj):
            member = inspect.getattr_static(obj, part, None)
            if member is None or i != len(parts) - 1:
                return False
            documented = (property, type, staticmethod, classmethod)
            return inspect.isroutine(member) or isinstance(member, documented)
        else:
            return False
    return True


def _public_home(obj: griffe.Object) -> str | None:
    """The public path of the class that ``obj`` is or belongs to (``aiockpt.Checkpointer``), if any."""
    cls = obj if obj.is_class else obj.parent
    if cls is None or not cls.is_class or cls.parent is None:
        return None
    module = cls.parent.path
    candidates = ("aiockpt.sync." + cls.name,) if module == "aiockpt.sync" else ("aiockpt." + cls.name,)
    return next((c for c in candidates if _public(c)), None)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def fence_literal_blocks(text: str) -> str:
    """Turn each ``Title::`` + blank line + indented block into ``Title:`` + a fenced python block."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::") and i + 1 < len(lines) and not lines[i + 1].strip():
            j = i + 2
            while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > _indent(line)):
                j += 1
            while j > i + 2 and not lines[j - 1].strip():
                j -= 1
            block = lines[i + 2 : j]
            if block:
                # Dedented to the introducing line: kept indented, Markdown would see an indented block.
                cut = min(_indent(b) for b in block if b.strip()) - _indent(line)
                pad = " " * _indent(line)
                out += [line.rstrip()[:-1], "", pad + "```python", *(b[cut:] for b in block), pad + "```"]
                i = j
                continue
        out.append(line)
        i += 1
    return "\n".join(out)


def rewrite(text: str, obj: griffe.Object) -> str:
    """Rewrite the reStructuredText of docstring ``text`` (of ``obj``) as Markdown (module docstring)."""

    def replace(match: re.Match[str]) -> str:
        raw = match["target"]
        short = raw.startswith("~")
        target = raw.lstrip("~").lstrip(".")
        shown = target.rsplit(".", 1)[-1] if short else target
        home = _public_home(obj)
        for candidate in (
            target,
            f"aiockpt.{target}",
            f"aiockpt.sync.{target}" if obj.path.startswith("aiockpt.sync") else "",
            f"{home}.{target}" if home else "",
        ):
            if candidate and _public(candidate):
                return f"[`{shown}`][{candidate}]"
        return f"`{shown}`"

    return _ROLE.sub(replace, fence_literal_blocks(text))


class SphinxRoles(griffe.Extension):
    """Rewrite the roles of every docstring as its object is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring, if it has one."""
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value, obj)
