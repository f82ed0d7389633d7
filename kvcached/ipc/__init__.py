"""Scheduler -> worker fan-out of map/unmap over Unix sockets.

The scheduler (vLLM EngineCore, a TP group's coordinator) owns the page ledger;
every worker process owns its KV tensors. This package carries map/unmap from
the one to the others so every rank stays in the same mapping state.

Modules, one concern each:
  settings     environment knobs (KVCACHED_IPC_NAME, KVCACHED_IPC_TIMEOUT, KVCACHED_PP_SIZE)
  protocol     the wire format: frames, commands, bodies, error kinds (struct, no pickle)
  transport    socket I/O: framed reads with limits, peer credentials
  paths        per-instance socket root (0700), PP-aware socket paths, stale cleanup
  faults       test-only fault injection in the listener (KVCACHED_IPC_FAULT_INJECT)
  executor     the worker-side operations (vmm_ops) and the map transaction history
  listener     WorkerListener: one per worker process
  liveness     whether a worker process still exists (pidfd, /proc start time)
  peer         the coordinator's connection to one worker (connect, send, recv, death)
  coordinator  TPCoordinator: atomic MAP with rollback, two-phase UNMAP, fail closed

``kvcached.tp_ipc_util`` is the entry module with the upstream names.
"""
