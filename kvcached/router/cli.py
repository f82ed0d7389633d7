"""The ``kvcached`` command (and ``python -m kvcached.router``)::

kvcached serve CONFIG [--host H] [--port P]   run the router (docs/ROUTER.md)
kvcached check CONFIG                         check CONFIG, print each engine's command
kvcached --version
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from typing import List, Optional

from kvcached.router.config import ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcached", description="Many models behind one OpenAI-compatible endpoint.")
    p.add_argument("--version", action="store_true", help="print the version, commit and location, then exit")
    sub = p.add_subparsers(dest="command")
    s = sub.add_parser("serve", help="start the configured engines and serve one endpoint")
    s.add_argument("config", help="YAML or JSON config (docs/ROUTER.md)")
    s.add_argument("--host", help="listen address (default: the config's, else 127.0.0.1)")
    s.add_argument("--port", type=int, help="listen port (default: the config's, else 8080)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    c = sub.add_parser("check", help="check a config and print each engine's command line")
    c.add_argument("config")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.version:
        from kvcached import version_line

        print(version_line())
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    try:
        config = load_config(args.config)
        if args.command == "check":
            from kvcached.router.engines import engine_command

            for m in config.models:
                port = m.port or "<free port>"
                cmd = " ".join(shlex.quote(str(a)) for a in engine_command(m, "127.0.0.1", port))  # type: ignore[arg-type]
                print(f"{m.name}: sleep={m.sleep_mode()} idle_seconds={m.idle_seconds} instance={m.instance}\n  {cmd}")
            if config.max_awake is not None:
                print(
                    f"max_awake={config.max_awake}: the first {config.max_awake} start; the rest on their first request"
                )
            return 0
        logging.basicConfig(
            level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
        )
        from kvcached.router.server import serve

        return serve(config, host=args.host, port=args.port)
    except ConfigError as e:
        print(f"kvcached: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
