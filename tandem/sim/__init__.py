"""``tandem simulate`` and ``tandem plan --slo``: tandem's own control plane (router policies,
the prefill decision, each worker's scheduler and block manager) on a virtual clock, the
forward replaced by a step-time model and the KV transfer by bytes over a link."""
