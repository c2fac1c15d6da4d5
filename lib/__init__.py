"""thunder-runbook's one shared package: only what two or more bin/ scripts use.

    paths, atomic, jsonl, hashing   repo paths and run folders, crash-safe writes, JSONL, sha256
    log                             event lines, RunbookError, the one table of failure
                                    categories, exit codes and anchors (FAILURES), OOM_RE
    hostfile, remote                mlx.launch's hostfile; running a command on a host (ssh)
    config                          run configs (mlx-lm lora keys): train, plan, compare, calibrate
    checkpoint                      crash-safe checkpoints: train writes, smoke verifies
    launch                          launch, watchdog, sweep, fetch, categorize: smoke and run
                                    (train/control); provenance helpers for compare, plan, calibrate
    parity, parity_probe            check-parity's checks (check_parity, sync, provision)
"""

__version__ = "0.1.0"
