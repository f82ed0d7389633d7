"""kvcached for vLLM. ``interfaces`` is upstream's import path of the API in
``kvcached.compat.vllm_interfaces`` (code written against upstream kvcached
calls it); importing it does not import vLLM."""
