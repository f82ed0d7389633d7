import importlib
import sys

from kvcached.bench import BENCHMARKS


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        print("usage: python -m kvcached.bench <benchmark> [options]\n\nbenchmarks:")
        for name, what in BENCHMARKS.items():
            print(f"  {name:<10} {what}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    mod = importlib.import_module(f"kvcached.bench.{argv[0]}")
    return int(mod.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
