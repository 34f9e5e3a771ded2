"""S3Options refuses, when it is made, every value that the client would later fail on inside a save."""

from __future__ import annotations

import math
from typing import Any

import pytest

import aiockpt
from aiockpt import S3Options

BAD = [
    ("endpoint", 5),
    ("endpoint", ""),
    ("region", 5),
    ("region", ""),
    ("part_size", 1.5),
    ("part_size", True),
    ("part_size", "8MB"),
    ("part_size", 0),
    ("part_size", 1 << 41),
    ("concurrency", 2.5),
    ("concurrency", 0),
    ("concurrency", "4"),
    ("max_retries", 1.5),
    ("max_retries", "3"),
    ("max_retries", -1),
    ("max_retries", 2**64),
    ("retry_timeout", math.nan),
    ("retry_timeout", math.inf),
    ("retry_timeout", -1.0),
    ("retry_timeout", False),
    ("request_timeout", math.inf),
    ("request_timeout", 0),
    ("request_timeout", 1e14),
    ("stale_after", math.nan),
    ("stale_after", "60"),
    ("lease_timeout", "60"),
    ("lease_timeout", 0.0),
    ("lease_timeout", math.nan),
]


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_a_bad_value_is_refused_naming_the_field_and_the_value(name: str, value: Any) -> None:
    with pytest.raises(aiockpt.CheckpointError) as info:
        S3Options(**{name: value})
    assert f"S3Options.{name} must be" in str(info.value)
    assert repr(value) in str(info.value)


def test_good_values_are_taken() -> None:
    opts = S3Options(
        endpoint="http://127.0.0.1:9000",
        region="us-east-1",
        part_size=64 << 10,  # under S3's 5 MiB: stores that allow it take it
        concurrency=1,
        max_retries=0,
        retry_timeout=0,
        request_timeout=0.5,
        stale_after=0.0,
        lease_timeout=3,
    )
    assert opts.part_size == 64 << 10
    assert opts.retry_timeout == 0
