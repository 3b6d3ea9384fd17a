"""`disagg-operator`: run the kopf operator for DisaggregatedModels."""

import argparse
import logging
import random
import sys
import time

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
    p.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority of this replica (the highest is active); default: the older replica ranks higher",
    )
    p.add_argument("--liveness", metavar="URL", help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--debug", action="store_true")
    return p.parse_args(argv)


# Random values per millisecond: the priority stays within a signed 64-bit integer (the API server's own).
TIE_BREAK = 1_000_000


def seniority_priority(started_at: float) -> int:
    """A peering priority that ranks replicas by age: the one started first is higher.

    kopf pauses every operator that sees a live peer of the same priority, itself included, so replicas of one
    Deployment started with one fixed priority would all stand still. Ranked by start time (milliseconds),
    they are distinct (a random part tells apart two started in one millisecond, which the replicas of a
    Deployment scaled from 0 to 2 on one node did); the active replica stays active when a new one starts (a
    rolling update does not move the work to a replica that has not warmed up), and when it goes, the oldest
    of the rest takes over.
    """
    return -(int(started_at * 1000) * TIE_BREAK + random.randrange(TIE_BREAK))


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
        priority=seniority_priority(time.time()) if args.priority is None else args.priority,
        liveness_endpoint=args.liveness,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
