"""Moved to kvcached.naming (one rule set for every name). This shim only keeps
existing importers working until they switch; delete it then.

Importers left (owners switch them): kvcached/limits/instance.py,
kvcached/integration/vllm/worker_tensors.py, tests/test_limits_instance.py.
"""

from kvcached.naming import (  # noqa: F401
    ENV_IPC_NAME,
    MAX_NAME_LEN,
    default_instance_name,
    instance_name,
    validate_name,
)
from kvcached.naming import group_name as group_record_name  # noqa: F401
