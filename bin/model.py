#!/usr/bin/env python3
"""model: fetch a model from the Hugging Face Hub into MODEL, recording where it came from.

Usage:
    python bin/model.py --repo ORG/NAME --out DIR [--revision REV] [--quantize 4|8]
                        [--group-size N] [--replace]

Example:
    .venv/bin/python bin/model.py --repo google/gemma-4-E2B-it --out models/gemma-4-e2b
    make model HF_REPO=mlx-community/gemma-4-e2b-it-4bit MODEL=models/gemma-4-e2b-4bit

The revision (default main: a branch, tag or commit) is resolved to its commit first, and the
download and the record are pinned to that commit. huggingface_hub's snapshot_download fetches
the files mlx-lm itself fetches into the Hugging Face cache; they are copied into a temporary
sibling of DIR as they are, or quantized on this machine with mlx-lm's own convert (affine,
--group-size, default 64). DIR/provenance.json records the repo, revision, commit, every file's
sha256, the quantization (bits and group size, or null) and the versions of mlx, mlx_lm and
huggingface_hub; then the folder is swapped in whole. With HF_HUB_OFFLINE=1 it works from a
populated cache (HF_HOME / HF_HUB_CACHE).

DIR is never silently replaced: the same repo, commit and quantization with the bytes its
provenance.json records is a no-op that says so; anything else is refused, naming what is
there, unless --replace (make model ... REPLACE=1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import time
from importlib.metadata import version as pkg_version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib import atomic, paths  # noqa: E402
from lib.hashing import sha256_file  # noqa: E402
from lib.log import RunbookError, die, event  # noqa: E402

ANCHOR = "model"
TOOLS = {"mlx": "mlx", "mlx_lm": "mlx-lm", "huggingface_hub": "huggingface_hub"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Fetch a model from the Hugging Face Hub into a folder, with provenance.")
    p.add_argument("--repo", required=True, help="Hugging Face repository id, e.g. google/gemma-4-E2B-it")
    p.add_argument("--out", required=True, type=Path, help="the model folder to write (MODEL)")
    p.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    p.add_argument("--quantize", type=int, choices=[4, 8], help="bits: quantize with mlx-lm's convert")
    p.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128], help="quantization group size (64)")
    p.add_argument("--replace", action="store_true", help="replace a different model already in --out")
    return p


def hub_error(what: str, e: Exception) -> RunbookError:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return RunbookError(
        f"{what}: {type(e).__name__}: {first}; check the repository id and revision on huggingface.co "
        "(a gated model: accept its licence there and run `hf auth login`); with HF_HUB_OFFLINE=1 the "
        "Hugging Face cache (HF_HOME) must already hold it: fetch once where the Hub is reachable", ANCHOR)


def resolve(repo: str, revision: str) -> str:
    """The commit a branch or tag points to now (offline: the one the cache's refs/ recorded)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, RevisionResolutionError

    try:
        return HfApi().resolve_revision(repo, revision=revision, local_files_only=constants.HF_HUB_OFFLINE).resolved
    except (HfHubHTTPError, RevisionResolutionError, OSError, ValueError) as e:
        raise hub_error(f"cannot resolve {repo}@{revision}", e) from e


def fetch(repo: str, commit: str) -> Path:
    """The cache's snapshot folder of repo@commit with mlx-lm's files, downloaded if missing."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(snapshot_download(repo, revision=commit, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise hub_error(f"cannot fetch {repo}@{commit[:12]}", e) from e


def hashes(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file but provenance.json."""
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.relative_to(folder).as_posix() != "provenance.json"}


def describe(repo: str, commit: str, quant: dict | None) -> str:
    q = f"{quant['bits']}-bit, group size {quant['group_size']}" if quant else "not quantized here"
    return f"{repo}@{commit[:12]} ({q})"


def already_there(out: Path, repo: str, commit: str, quant: dict | None) -> bool:
    """True when out holds exactly this model; a RunbookError when it holds anything else."""
    if not out.exists():
        return False
    how = "to replace it on purpose: make model ... REPLACE=1 (bin/model.py --replace); or choose another MODEL"
    try:
        prov = json.loads((out / "provenance.json").read_text(encoding="utf-8"))
        have, files = (prov["repo"], prov["commit"], prov["quantization"]), prov["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RunbookError(f"{out} exists but has no provenance.json from bin/model.py ({type(e).__name__}: {e}); "
                           f"refusing to replace it; {how}", ANCHOR) from e
    if have != (repo, commit, quant):
        raise RunbookError(f"{out} holds {describe(*have)}, not {describe(repo, commit, quant)}; "
                           f"refusing to replace it; {how}", ANCHOR)
    now = hashes(out)
    changed = sorted(set(now) ^ set(files) | {k for k in files if now.get(k) != files[k]})
    if changed:
        raise RunbookError(f"{out} holds {describe(*have)} but these files differ from its provenance.json: "
                           f"{', '.join(changed[:5])}; refusing to replace it; {how}", ANCHOR)
    return True


def quantize(snapshot: Path, dest: Path, bits: int, group_size: int) -> None:
    """mlx-lm's own convert of the snapshot into dest (which must not exist yet)."""
    from mlx_lm import convert

    config = json.loads((snapshot / "config.json").read_text(encoding="utf-8"))
    if "quantization" in config or "quantization" in config.get("text_config", {}):
        raise RunbookError(f"the repository is already quantized ({config.get('quantization')}): drop "
                           "QUANTIZE (--quantize), or fetch its bf16 original and quantize that", ANCHOR)
    with contextlib.redirect_stdout(sys.stderr):  # convert's [INFO] lines; stdout is our one event line
        convert(hf_path=str(snapshot), mlx_path=str(dest), quantize=True, q_bits=bits, q_group_size=group_size)


def build(snapshot: Path, tmp: Path, args: argparse.Namespace) -> None:
    """Fill tmp: the snapshot's files as they are, or quantized."""
    if args.quantize:
        quantize(snapshot, tmp / "converted", args.quantize, args.group_size)
        for p in (tmp / "converted").iterdir():
            p.rename(tmp / p.name)
        (tmp / "converted").rmdir()
        return
    for src in sorted(p for p in snapshot.rglob("*") if p.is_file()):
        dest = tmp / src.relative_to(snapshot)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)  # follows the cache's link to its blob


def main() -> int:
    args = build_parser().parse_args()
    t0 = time.monotonic()
    quant = {"bits": args.quantize, "group_size": args.group_size, "mode": "affine", "by": "mlx_lm.convert"} \
        if args.quantize else None
    try:
        commit = resolve(args.repo, args.revision)
        if not args.replace and already_there(args.out, args.repo, commit, quant):
            event("model", status="unchanged", repo=args.repo, revision=args.revision, commit=commit,
                  out=paths.rel(args.out), note="same repo, commit, quantization and bytes: nothing to do")
            return 0
        snapshot = fetch(args.repo, commit)
        if not (snapshot / "config.json").is_file() or not list(snapshot.glob("model*.safetensors")):
            raise RunbookError(f"{args.repo}@{commit[:12]} has no config.json and model*.safetensors: "
                               "not a model mlx-lm loads (safetensors only)", ANCHOR)
        with atomic.atomic_dir(args.out) as tmp:
            build(snapshot, tmp, args)
            files = hashes(tmp)
            config = json.loads((snapshot / "config.json").read_text(encoding="utf-8"))
            atomic.write_json(tmp / "provenance.json", {
                "fetched_by": "bin/model.py", "repo": args.repo, "revision": args.revision, "commit": commit,
                "quantization": quant, "repo_quantization": config.get("quantization"),
                "tools": {name: pkg_version(dist) for name, dist in TOOLS.items()}, "files": files,
            })
    except RunbookError as e:
        return die(e)
    except OSError as e:
        return die(RunbookError(f"cannot write {args.out}: {e}; check the folder is writable and the disk has "
                                "room for the model twice (the cache and MODEL)", ANCHOR))
    event("model", status="fetched", repo=args.repo, revision=args.revision, commit=commit,
          quantize=args.quantize or "none", files=len(files),
          bytes=sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file()),
          out=paths.rel(args.out), seconds=round(time.monotonic() - t0, 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
