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


def helper_anchors() -> dict[str, str]:
    """Anchors code_anchors() cannot see: the last argument of export's fail() and hostfile's
    need() (each wraps RunbookError), and ANCHOR constants assigned in a tuple
    (`ANCHOR, FORMAT = "calibrate", ...`)."""
    found = {}
    for path in sorted([*ROOT.glob("bin/*.py"), *ROOT.glob("lib/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("fail", "need") and node.args:
                last = node.args[-1]
                if (isinstance(last, ast.Constant) and isinstance(last.value, str)
                        and re.fullmatch(r"[a-z0-9][a-z0-9_-]*", last.value)):
                    found.setdefault(last.value, f"{path.name}:{node.lineno}")
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
                for t in node.targets:
                    for name, value in zip(getattr(t, "elts", []), node.value.elts, strict=False):
                        if "ANCHOR" in getattr(name, "id", "") and isinstance(value, ast.Constant):
                            found.setdefault(value.value, f"{path.name}:{node.lineno}")
    return found


def test_anchors_behind_helpers_exist():
    found = helper_anchors()
    assert {"paths", "export-no-input", "calibrate", "plan"} <= set(found), sorted(found)
    have = runbook_anchors()
    missing = {a: where for a, where in found.items() if a not in have}
    assert not missing, f"RUNBOOK.md lacks headings for {missing}"


def test_runbook_is_in_the_cards_order():
    """The operator's order: the real run, the failure table, one fix section per anchor, the stage
    reference. (Its byte cap is gone: it was met by squeezing prose.)"""
    text = (ROOT / "RUNBOOK.md").read_text()
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert sections == ["The real run", "Failure table", "Fixes by anchor", "Stage reference"], sections


def test_failure_table_has_its_columns_and_rows():
    """One table: symptom | stage | cause | check | fix | verify, with a row (a link to the fix)
    for each of DESIGN.md's categories and the failures the issues named."""
    section = (ROOT / "RUNBOOK.md").read_text().split("\n## Failure table\n", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("|")]
    assert rows and rows[0].lower().replace(" ", "").startswith(
        "|symptom(asprinted)|stage|cause|check|fix|verify|"), rows[:1]
    links = set(re.findall(r"\]\(#([a-z0-9_-]+)\)", section))
    want = {*CATEGORIES.values(), "parity-tcc", "parity-fast-synch", "export-dataset-bound", "settings",
            "out-of-memory"}
    assert want <= links, f"the failure table has no row for {sorted(want - links)}"


def test_runbook_links_resolve_and_headings_are_unique():
    """A `[x](#anchor)` link lands on its heading; two equal headings would send GitHub's
    anchor to the first one only."""
    text = (ROOT / "RUNBOOK.md").read_text()
    heads = [github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)]
    dupes = sorted({h for h in heads if heads.count(h) > 1})
    assert not dupes, f"RUNBOOK.md has duplicate headings: {dupes}"
    dead = sorted(set(re.findall(r"\]\(#([a-z0-9_-]+)\)", text)) - set(heads))
    assert not dead, f"RUNBOOK.md links to missing headings: {dead}"


# No line caps on bin/ and lib/ any more (they were met by packing lines); no function over 80 lines.
def test_no_function_is_over_80_lines():
    import ast

    files = sorted([*ROOT.glob("bin/*.py"), *ROOT.glob("lib/*.py")])
    long = [(f.name, n.name, n.end_lineno - n.lineno + 1) for f in files for n in ast.walk(ast.parse(f.read_text()))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno - n.lineno >= 80]
    assert not long, f"functions over 80 lines: {long}"
