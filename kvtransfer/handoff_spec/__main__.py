"""`python -m tandem.kvtransfer.handoff_spec`: explore the handoff model and print the
states explored, the time, and OK or the counterexample trace (exit status 1 then).

    python -m tandem.kvtransfer.handoff_spec                        # the correct model
    python -m tandem.kvtransfer.handoff_spec --bug free_before_revoke
    python -m tandem.kvtransfer.handoff_spec --path zmq --bug prefill_preemption --chunks 2 --layers 1
"""

from __future__ import annotations

import argparse
import dataclasses

from tandem.kvtransfer.handoff_spec.checker import explore
from tandem.kvtransfer.handoff_spec.model import HandoffModel
from tandem.kvtransfer.handoff_spec.state import SHM, ZMQ, Config

BUGS = ("free_before_revoke", "free_while_revoking", "no_epoch_check", "prefill_preemption", "no_receiver_deadline")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.kvtransfer.handoff_spec",
                                     description="Explore the KV handoff model; print OK or a counterexample.")
    defaults = Config()
    for name in ("requests", "layers", "chunks", "blocks", "faults", "cancels"):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    parser.add_argument("--path", choices=(SHM, ZMQ), default=defaults.path)
    parser.add_argument("--bug", choices=BUGS, action="append", default=[], help="plant a bug (repeatable)")
    parser.add_argument("--no-liveness", action="store_true", help="skip the reverse reachability pass")
    parser.add_argument("--max-states", type=int, default=None, help="stop (incomplete) at this many states")
    args = parser.parse_args(argv)
    cfg = dataclasses.replace(defaults, requests=args.requests, layers=args.layers, chunks=args.chunks,
                              blocks=args.blocks, faults=args.faults, cancels=args.cancels, path=args.path,
                              **{bug: True for bug in args.bug})
    model = HandoffModel(cfg)
    print(cfg)
    report = explore(model, check_liveness=not args.no_liveness, max_states=args.max_states)
    print(report.format(model))
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
