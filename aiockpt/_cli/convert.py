"""``aiockpt convert SRC DST --to FORMAT``: between aiockpt, DCP, safetensors and ``torch.save`` files."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import anyio
import click

from .._errors import CheckpointError
from .._format import RANKS_VERSION
from .._interop._convert import Target, convert
from .._load import is_checkpoint, read_manifest
from ._common import (
    human_bytes,
    json_option,
    no_progress_option,
    print_json,
    progress_bar,
    resolve_checkpoint,
    show_progress,
    step_option,
)

SCHEMA = "aiockpt.convert/1"


def _per_rank(source: Path) -> bool:
    """Whether ``source`` is an aiockpt checkpoint holding per-rank state (a manifest of format 3)."""
    if not is_checkpoint(source):
        return False
    try:
        return read_manifest(source).format_version >= RANKS_VERSION
    except CheckpointError:
        return False  # (the conversion reports it)


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", re.IGNORECASE)
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_size(ctx: click.Context | None, param: click.Parameter | None, value: object) -> int:
    """A byte count: ``5000000``, ``500MB`` (10^6), ``512MiB`` (2^20), ``5GB``, ``1.5GiB``.

    Raises:
        click.BadParameter: ``value`` is not a size, or not positive (reported as a usage error).
    """
    if isinstance(value, int):
        return value
    m = _SIZE.fullmatch(str(value))
    if m is None:
        raise click.BadParameter(f"{value!r} is not a size (examples: 5GB, 512MiB, 1000000)", ctx, param)
    number, unit, binary = m.groups()
    size = int(float(number) * (1024 if binary else 1000) ** _POWERS[unit.upper()])
    if size <= 0:
        raise click.BadParameter(f"{value!r} is not a positive size", ctx, param)
    return size


@click.command("convert", short_help="Convert between aiockpt, DCP, safetensors and torch.save.")
@click.argument("src")
@click.argument("dst")
@click.option(
    "--to",
    "to",
    type=click.Choice(get_args(Target)),
    required=True,
    help="The format of DST: an aiockpt checkpoint directory, a torch.save file, safetensors (DST ending "
    "in .safetensors is one file, anything else a Hugging Face directory), or a DCP directory.",
)
@step_option
@click.option(
    "--max-shard-size",
    type=str,
    callback=parse_size,
    default="5GB",
    show_default=True,
    help="safetensors directories: bytes of tensor data per shard (e.g. 5GB, 512MiB).",
)
@click.option("--drop-non-tensors", is_flag=True, help="safetensors: leave out values that are not tensors.")
@click.option(
    "--allow-pickle",
    is_flag=True,
    help="Read pickled objects in SRC and write them to DST. Only for checkpoints you trust: unpickling "
    "runs code.",
)
@click.option(
    "--rank",
    type=click.IntRange(min=0),
    default=None,
    help="For SRC saved by several ranks whose states differ (per-rank state): whose to convert (default 0). "
    "For an aiockpt SRC, a rank that did not save it is refused.",
)
@no_progress_option
@json_option
def command(
    src: str,
    dst: str,
    to: Target,
    step: int | None,
    max_shard_size: int,
    drop_non_tensors: bool,
    allow_pickle: bool,
    rank: int | None,
    no_progress: bool,
    as_json: bool,
) -> None:
    """Convert the checkpoint SRC into a new checkpoint DST.

    SRC is an aiockpt checkpoint (or a Checkpointer root: its newest step, or --step), a DCP directory,
    a safetensors file or Hugging Face directory, or a torch.save file. DST must not exist; it appears
    only once complete (written under a temp name, fsynced, renamed). safetensors holds tensors only:
    other values are refused, with their keys listed, unless --drop-non-tensors. Of a checkpoint whose
    ranks saved different states (per-rank state), one rank's is converted: --rank, by default 0 (one of
    the ranks that saved an aiockpt SRC).
    """
    source, note = resolve_checkpoint(src, step)
    if note is not None and not as_json:
        click.echo(f"converting {source.name}, {note}", err=True)
    chosen = 0 if rank is None else rank
    if rank is None and not as_json and _per_rank(source):
        click.echo(
            f"{source} holds per-rank state: converting rank 0's (--rank picks another rank's)", err=True
        )
    total = 0
    with progress_bar(show_progress(no_progress) and not as_json, f"converting to {to}") as bar:

        def progress(done: int, of: int) -> None:
            nonlocal total
            total = of
            if bar is not None:
                bar(done, of)

        written = anyio.run(
            lambda: convert(
                source,
                dst,
                to=to,
                allow_pickle=allow_pickle,
                drop_non_tensors=drop_non_tensors,
                max_shard_size=max_shard_size,
                progress=progress,
                rank=chosen,
            )
        )
    if as_json:
        doc = {"schema": SCHEMA, "source": str(source), "path": str(written), "to": to, "nbytes": total}
        print_json(doc | {"rank": chosen})
    else:
        click.echo(f"wrote {written} ({to}, {human_bytes(total)} of tensors) from {source}")
