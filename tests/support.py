"""Small builders the tests share with the benchmarks. bench/ never imports tests/, so the one
copy lives in bench/fabric_cli.py (which imports nothing but lib/ at import time) and is
re-exported here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from fabric_cli import SPLITS, copy_code, write_manifest  # noqa: E402

__all__ = ["SPLITS", "copy_code", "path_without", "shard_model", "write_manifest"]


def shard_model(model: Path, n: int = 2) -> list[str]:
    """Rewrite model.safetensors as n shards and model.safetensors.index.json, as the Hub publishes
    models over 5 GB; returns the shard names."""
    import json

    from safetensors.numpy import load_file, save_file

    weights = load_file(str(model / "model.safetensors"))
    names, weight_map = sorted(weights), {}
    files = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for i, fname in enumerate(files):
        part = names[i::n]
        save_file({k: weights[k] for k in part}, str(model / fname), metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(part, fname))
    (model / "model.safetensors").unlink()
    total = sum(v.nbytes for v in weights.values())
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return files


def path_without(tool: str, bindir: Path) -> str:
    """A PATH of one folder, `bindir`, linking every program on this PATH but `tool`: this machine
    as it would be without it."""
    bindir.mkdir(parents=True, exist_ok=True)
    for d in os.environ["PATH"].split(os.pathsep):
        for exe in Path(d).glob("*") if Path(d).is_dir() else []:
            if exe.name != tool and not (bindir / exe.name).exists() and os.access(exe, os.X_OK):
                (bindir / exe.name).symlink_to(exe)
    return str(bindir)
