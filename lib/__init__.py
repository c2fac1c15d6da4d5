"""thunder-runbook's one shared package: only what two or more bin/ scripts use.

Modules: paths (repo root, run folders), atomic (crash-safe writes), jsonl,
log (event lines and errors that name their RUNBOOK fix).
"""

__version__ = "0.1.0"
