"""kvcached for vLLM. ``interfaces`` is the API the vLLM adapter (and code
written against upstream kvcached) calls; importing it does not import vLLM."""
