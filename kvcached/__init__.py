"""kvcached: elastic KV cache for vLLM and SGLang.

Importing the package is cheap on purpose (it runs at interpreter start through
kvcached_autopatch.pth): the extension and torch load only when used.
"""

__version__ = "0.2.0"
