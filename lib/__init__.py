"""thunder-runbook's one shared package: what the bin/ scripts share, and who uses it.

    paths, atomic, jsonl, hashing  repo paths and run folders, crash-safe writes, JSONL, sha256 (most scripts)
    log                            event lines, RunbookError, the one table of failure categories,
                                   exit codes and anchors (FAILURES), OOM_RE (every script)
    hostfile, remote               mlx.launch's hostfile; a command on a host over ssh (check_parity,
                                   sync, provision, calibrate, plan, run, status; launch, parity)
    config                         run configs, mlx-lm lora keys (train, calibrate, plan, compare;
                                   launch, checkpoint)
    dataset                        the dataset manifest: reader, corpus binding (export, sync, check_parity)
    checkpoint                     crash-safe checkpoints and resume rules (train writes, smoke verifies)
    launch                         launch, watchdog, sweep, fetch, categorize, restarts (smoke, run);
                                   run manifests, reproduce.sh, provenance (compare, plan, calibrate, status)
    loss                           the chunked LoRA loss over the final hidden states (train; calibrate
                                   measures it through train's own step)
    parity, parity_probe           check-parity's checks and the probe it sends to every host
                                   (check_parity only: parity_probe is the host-side half)
"""
