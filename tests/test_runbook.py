"""Every error names its fix: each RUNBOOK anchor the code prints exists as a heading."""

from __future__ import annotations

import ast
import re

from conftest import ROOT

from lib.log import CATEGORIES


def github_anchor(heading: str) -> str:
    """GitHub's heading id: lower case, punctuation dropped, spaces to dashes."""
    h = heading.strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def runbook_anchors() -> set[str]:
    text = (ROOT / "RUNBOOK.md").read_text()
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def code_anchors() -> dict[str, str]:
    """anchor -> where, from `RUNBOOK.md#x` literals and RunbookError(msg, "x") calls."""
    found = {}
    for path in sorted([*ROOT.glob("bin/*.py"), *ROOT.glob("lib/*.py")]):
        src = path.read_text()
        for m in re.finditer(r"RUNBOOK\.md#([a-z0-9][a-z0-9_-]*[a-z0-9])\b(?![{-])", src):
            if m.group(1) != "anchor":  # the placeholder word in docstrings
                found.setdefault(m.group(1), f"{path.name}")
        tree = ast.parse(src)
        consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                  and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                  for t in n.targets if isinstance(t, ast.Name) and "ANCHOR" in t.id}
        def consts_in(expr):
            return [c.value for c in ast.walk(expr) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                    and re.fullmatch(r"[a-z0-9][a-z0-9_-]*", c.value) and c.value != "anchor"]

        for node in ast.walk(tree):
            name = getattr(node.func, "id", getattr(node.func, "attr", "")) if isinstance(node, ast.Call) else ""
            pos = {"RunbookError": 1, "Failure": 4}.get(name)
            if pos is not None:
                anchor = node.args[pos] if len(node.args) > pos else next(
                    (k.value for k in node.keywords if k.arg == "anchor"), None)
                if isinstance(anchor, ast.Name) and anchor.id in consts:
                    found.setdefault(consts[anchor.id], f"{path.name}:{node.lineno}")
                elif anchor is not None:
                    for c in consts_in(anchor):
                        found.setdefault(c, f"{path.name}:{node.lineno}")
            # self.anchor = anchor or (... else "trainer"), ANCHOR = "config", ...
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    tname = getattr(t, "id", getattr(t, "attr", ""))
                    if "anchor" in tname.lower():
                        for c in consts_in(node.value):
                            found.setdefault(c, f"{path.name}:{node.lineno}")
    for anchor in CATEGORIES.values():
        found.setdefault(anchor, "lib/log.py CATEGORIES")
    return found


def test_every_printed_anchor_exists():
    have = runbook_anchors()
    missing = {a: where for a, where in code_anchors().items() if a not in have}
    assert not missing, f"RUNBOOK.md lacks headings for {missing}"


def test_anchor_scan_finds_something():
    found = code_anchors()
    assert {"sync-refused", "hostfile", "runtime-parity", "parity-ssh"} <= set(found), sorted(found)


def test_every_export_reject_reason_has_its_heading():
    import importlib.util

    spec = importlib.util.spec_from_file_location("export_script", ROOT / "bin" / "export.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    reasons = set(mod.REASONS)
    have = runbook_anchors()
    assert reasons, "no reject reason found in bin/export.py"
    missing = sorted(r for r in reasons if f"reject-{r}" not in have)
    assert not missing, f"RUNBOOK.md lacks '### reject: <reason>' for {missing}"
