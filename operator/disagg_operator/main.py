"""`disagg-operator`: run the kopf operator for DisaggregatedModels."""

import argparse
import logging
import sys

import kopf


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="disagg-operator", description=__doc__)
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch this namespace (repeatable); default: all namespaces",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    p.add_argument(
        "--peering",
        metavar="NAME",
        help="kopf peering object for HA: one active operator among replicas (default: standalone)",
    )
    p.add_argument("--standalone", action="store_true", help="no peering even if --peering is given")
    p.add_argument("--priority", type=int, default=0, help="peering priority of this replica")
    p.add_argument("--liveness", metavar="URL", help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--debug", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kopf.configure(verbose=args.verbose, debug=args.debug)
    if not (args.verbose or args.debug):  # one line per handled event is too much for a busy cluster
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    from . import handlers  # noqa: F401  (registers the handlers)

    standalone = args.standalone or not args.peering
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=standalone,
        peering_name=None if standalone else args.peering,
        priority=args.priority,
        liveness_endpoint=args.liveness,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
