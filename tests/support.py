"""Small builders the tests share with the benchmarks. bench/ never imports tests/, so the one
copy lives in bench/fabric_cli.py (which imports nothing but lib/ at import time) and is
re-exported here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from fabric_cli import SPLITS, copy_code, write_manifest  # noqa: E402

__all__ = ["SPLITS", "copy_code", "path_without", "shard_model", "wandb_history", "write_manifest"]


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


def wandb_history(sync_dir: Path) -> dict[int, dict]:
    """What a W&B run folder holds for upload: its history rows by step, {key: value}. The run-ID.wandb file
    is a LevelDB-format log (a 7-byte header, then 32 KiB blocks of records: crc32c, length, type) of
    wandb's protobuf Records; wandb 0.30 ships the protobufs but no reader, so this is one."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    (f,) = Path(sync_dir).glob("run-*.wandb")
    data, pos, block, rows = f.read_bytes(), 7, 32768, {}
    assert data[:4] == b":W&B", f"{f} is not a W&B transaction log"
    buf = b""
    while pos + 7 <= len(data):
        if (left := block - pos % block) < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and n == 0:  # zero padding to the end of the block
            pos += left
            continue
        buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a FULL record, or the LAST piece of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                rows.setdefault(rec.history.step.num, {}).update(items)
    return rows


def wandb_mismatches(run_dir: Path, sync_dir: Path) -> list[str]:
    """Each number of each metrics.jsonl event (its KIND/KEY at its step) that W&B's history does not hold as
    written; two events of one kind at one step keep the later's, as W&B does. [] when they agree."""
    import json

    rows, want = wandb_history(sync_dir), {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        ev = json.loads(line)
        want.update({(ev["step"], f"{ev['kind']}/{k}"): v for k, v in ev.items() if k not in ("step", "kind")
                     and isinstance(v, int | float) and not isinstance(v, bool)})
    return [f"step {s} {k}: metrics.jsonl {v!r}, W&B {rows.get(s, {}).get(k, 'missing')!r}"
            for (s, k), v in want.items() if rows.get(s, {}).get(k) != v]
