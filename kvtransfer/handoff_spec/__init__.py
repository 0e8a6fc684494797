"""An executable specification of the KV handoff between a prefill and a decode worker
(issue 32, item 4): the protocol as a model (model.py over state.py's states), an
explicit-state checker that explores every interleaving (checker.py), the properties it
checks (properties.py) and each side's table of local states (tables.py), for checking
recorded runs of the real workers. docs/handoff-spec.md says what is modelled and how.
"""

from tandem.kvtransfer.handoff_spec.checker import Report, Step, Violation, explore
from tandem.kvtransfer.handoff_spec.model import HandoffModel
from tandem.kvtransfer.handoff_spec.state import SHM, ZMQ, Config, Status
from tandem.kvtransfer.handoff_spec.tables import DECODE_TABLE, PREFILL_TABLE, PathVerdict, is_path

__all__ = ["Config", "DECODE_TABLE", "HandoffModel", "PREFILL_TABLE", "PathVerdict", "Report", "SHM", "Status", "Step",
           "Violation", "ZMQ", "explore", "is_path"]
