"""Per-instance limits in shared memory and the device budget.

  records   read-only views of the records (tools; no torch, no GPU library)
  budget    the device budget shared by all instances on a device
  instance  InstanceLimits: owns a record, watches it, caps a PageAllocator
  writer    the one writer of a limit: write it, wait for the owner's ack, say what happened

Sizes as people type and read them are ``kvcached.units``' (``format_size``,
``parse_size`` are re-exported here, as the record names are).

Record names (KVCACHED_IPC_NAME or kvcached_<engine>_<pid>, ``_g<g>`` per KV
group) are kvcached.naming's; ``instance_name`` and ``group_record_name`` are
re-exported here for existing callers.

Importing this package loads only the extension module, never torch.
"""

from kvcached.limits.budget import DeviceBudget, usable_device_bytes
from kvcached.limits.instance import InstanceLimits, owned_instances
from kvcached.limits.records import RecordView, list_records, read_record
from kvcached.naming import group_name as group_record_name
from kvcached.naming import instance_name
from kvcached.units import format_size, parse_size

__all__ = [
    "DeviceBudget",
    "InstanceLimits",
    "RecordView",
    "format_size",
    "group_record_name",
    "instance_name",
    "list_records",
    "owned_instances",
    "parse_size",
    "read_record",
    "usable_device_bytes",
]
