"""Operator tools: ``kvctl`` (list, limit, watch, delete, cleanup) and ``kvtop``
(live table). They read and write the instance records in /dev/shm through the
extension only: no torch, no GPU library, so they work over ssh."""
