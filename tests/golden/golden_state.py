"""The deterministic state stored in every golden checkpoint."""

from __future__ import annotations

import torch


def golden_state() -> dict[str, object]:
    """A small state touching every node kind and several dtypes, built without randomness."""
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    return {
        "model": {"weight": weight, "bias": torch.tensor([0.5, -1.5, 2.25], dtype=torch.bfloat16)},
        "tied": weight,
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.full((3, 4), 0.125)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "foreach": None}],
        },
        "mask": torch.tensor([True, False, True]),
        "ints": torch.arange(-4, 4, dtype=torch.int8),
        "complex": torch.tensor([1 + 2j, -3.5j], dtype=torch.complex64),
        "empty": torch.empty(0, 3, dtype=torch.float16),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "step": 42,
        "name": "golden",
        "blob": b"\x00\x01\xff",
        "ratio": 0.25,
        "flag": True,
        "nothing": None,
    }
