"""Per-instance limits in shared memory and the device budget.

  naming    record names (KVCACHED_IPC_NAME or kvcached_<engine>_<pgid>)
  units     sizes as people type and read them
  records   read-only views of the records (tools; no torch, no GPU library)
  budget    the device budget shared by all instances on a device
  instance  InstanceLimits: owns a record, watches it, caps a PageAllocator

Importing this package loads only the extension module, never torch.
"""

from kvcached.limits.budget import DeviceBudget, usable_device_bytes
from kvcached.limits.instance import InstanceLimits, owned_instances
from kvcached.limits.naming import group_record_name, instance_name
from kvcached.limits.records import RecordView, list_records, read_record
from kvcached.limits.units import format_size, parse_size

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
