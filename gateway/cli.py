"""The ``kvgate`` command: ``serve``, ``validate`` and ``sim``.

Each subcommand lives in its own module and is imported lazily, so ``kvgate validate`` does not pay for
importing the server stack.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _serve(args: argparse.Namespace) -> int:
    from gateway.server.serve import run

    return run(args)


def _validate(args: argparse.Namespace) -> int:
    from gateway.config import validate_file

    return validate_file(args.file)


def _sim(args: argparse.Namespace) -> int:
    from gateway.sim.cli import run

    return run(args.sim_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway in front of a vLLM server")
    serve.add_argument(
        "--upstream",
        action="append",
        help="vLLM base URL, e.g. http://127.0.0.1:8000; repeat it for a pool of engines",
    )
    serve.add_argument(
        "--upstream-dns",
        metavar="HOST[:PORT]",
        help="find the engines by DNS: every address of HOST (a Kubernetes headless Service) is an engine",
    )
    serve.add_argument("--host", help="address to listen on (default 0.0.0.0)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8080)")
    serve.add_argument(
        "--control-port", type=int, help="serve /healthz, /readyz and /metrics on this port only (listen.control_port)"
    )
    serve.add_argument("--config", help="YAML config file; flags override it")
    serve.add_argument(
        "--tokenizer",
        help="auto | MODEL_DIR | HUB_ID (org/name) | hf:PATH | tiktoken:NAME_OR_FILE | vllm | heuristic[:N]",
    )
    serve.add_argument(
        "--tokenizer-download",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fetch a hub tokenizer missing from the HF cache (config: tokenizer_download; default off)",
    )
    serve.add_argument("--log-level", default=None, help="debug, info, warning, error, critical (default info)")
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=25.0,
        help="on SIGTERM, seconds to let in-flight requests finish (keep below terminationGracePeriodSeconds)",
    )
    serve.set_defaults(func=_serve)

    validate = sub.add_parser("validate", help="check a config file and print each error with its location")
    validate.add_argument("file")
    validate.set_defaults(func=_validate)

    sim = sub.add_parser("sim", help="run the vLLM simulator (kvgate sim --help)", add_help=False)
    sim.add_argument("sim_args", nargs=argparse.REMAINDER)
    sim.set_defaults(func=_sim)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:  # the simulator parses its own flags, --help included
        from gateway.sim.cli import run

        return run(argv[1:])
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result
