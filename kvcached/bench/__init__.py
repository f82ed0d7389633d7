"""Benchmarks: ``python -m kvcached.bench <name> [--json] ...``.

Each benchmark is a module ``kvcached.bench.<name>`` with ``main(argv) -> int``;
it prints a table that puts our path beside a baseline measured in the same run.
"""

BENCHMARKS = {
    "vmm": "map/unmap throughput through kvcached vs raw backend calls",
    "manager": "KVCacheManager alloc/free rate vs vLLM's native BlockPool",
    "ipc": "map fan-out round trip to worker processes",
    "attention": "GPU decode attention over elastic vs native KV per layout, and map throughput",
    "sglang": "SGLang throughput and TTFT with and without kvcached, in one run",
    "vllm": "vLLM output tokens/s and TTFT with and without kvcached, in one run",
    "router": "latency and throughput the router adds in front of an engine (kvcached serve vs direct)",
    "burst": "where a burst's first second goes: want, peer wake, evict, unmap, grant, map, admit (a trace)",
}
