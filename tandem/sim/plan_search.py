"""``tandem plan --slo``'s search: which placement serves a workload at the highest request
rate per GPU with ``attainment`` (90%) of its requests within both SLO bounds (DistServe's
goodput), found by simulating tandem's own cluster (tandem.sim.run.simulate) at probed rates.

A configuration (Candidate) is one unit: colocated workers, or a prefill and a decode pool
(policy ``always`` or ``auto``), each pool's TP, the step's token budget and batch limit. Its
score: its highest passing rate (bench/serving/slo_search.RateSearch, at most ``max_probes``
probes) per GPU it uses. A deployment repeats the best unit to fill the GPUs (PlanSearch.verify).

Pruning, so that the search answers in about a minute on two cores:
- a TP size is proposed only where a rank holds its share of the weights with 10% of the
  memory spare and still has KV for a full-length sequence (Hardware.fitting_tps);
- coordinate descent: budgets at the first batch limit, then batch limits at the best
  budget, then TP sizes, then the prefill:decode ratio by hill climbing, each step keeping
  the best found before it;
- every configuration after the first of its family (colocated; disaggregated) is probed
  first at the family's best rate per GPU × its GPUs: when that fails, it cannot win and
  its search stops after one probe (recorded as ``pruned``, its rate an upper bound);
- no probe above a pass at burst_rate(), where the probe's requests all arrive within one
  request's time: a pool that batches them all passes any rate there (a lower bound).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tandem.bench.serving.slo_search import RateSearch, attainment
from tandem.config import ModelConfig
from tandem.config.names import DTYPE_BYTES
from tandem.sim.gpus import GpuSpec
from tandem.sim.spec import ClusterSpec, PoolSpec, StepTimeModel
from tandem.sim.workloads import Workload

logger = logging.getLogger(__name__)

MEMORY_FRACTION = 0.9
"""Share of a GPU's memory a rank uses for its weights and KV pool."""
SIM_BLOCKS_PER_SEQ = 4
"""Cap of a simulated pool: full-length sequences per batch slot (Hardware.sim_blocks)."""
ROUTINGS = ("least_loaded", "round_robin")
"""Router policies a deployment of several copies is checked under, in this order. (A unit
is searched under the first; copies of it may route worse: the router counts what it sent
a colocated worker only once a load poll shows it, so least_loaded can pile a burst onto one.)"""


@dataclass(frozen=True)
class Hardware:
    """The GPU, the model on it, and so the KV pool a worker of each TP size gets."""

    gpu: GpuSpec
    shape: ModelConfig
    dtype: str
    block_size: int = 16
    memory_fraction: float = MEMORY_FRACTION

    def kv_blocks(self, tp: int) -> int:
        """KV blocks of a worker of ``tp`` ranks: (memory × fraction − weights / tp) / a block's
        bytes on one rank (<= 0: the weights do not fit)."""
        weights = self.shape.num_parameters * DTYPE_BYTES[self.dtype] / tp
        free = self.gpu.memory_bytes * self.memory_fraction - weights
        return int(free // (self.block_size * self.shape.kv_bytes_per_token(self.dtype, tp)))

    def sim_blocks(self, tp: int, max_seqs: int) -> int:
        """kv_blocks(tp), at most SIM_BLOCKS_PER_SEQ full-length sequences per batch slot: a
        small model on a big GPU has millions of blocks no workload here fills, which only
        slow the simulated block manager's start."""
        full = -(-self.shape.context_limit() // self.block_size)
        return min(self.kv_blocks(tp), SIM_BLOCKS_PER_SEQ * max_seqs * full)

    def fits(self, tp: int) -> bool:
        """Whether ``tp`` ranks can shard the model and hold a full-length sequence's KV."""
        from tandem.parallel.shard import rank_shards

        try:
            rank_shards(self.shape, tp)
        except ValueError:
            return False
        return self.kv_blocks(tp) * self.block_size >= self.shape.context_limit()

    def fitting_tps(self, num_gpus: int) -> list[int]:
        """Powers of 2 up to ``num_gpus`` that fit (fits())."""
        return [tp for tp in (2**i for i in range(num_gpus.bit_length())) if tp <= num_gpus and self.fits(tp)]


@dataclass(frozen=True)
class Candidate:
    """One configuration: ``decode`` x ``decode_tp`` are the colocated workers in that mode."""

    mode: str
    policy: str | None
    prefill: int
    prefill_tp: int
    decode: int
    decode_tp: int
    budget: int
    max_seqs: int

    @classmethod
    def colocated(cls, workers: int, tp: int, budget: int, max_seqs: int) -> Candidate:
        return cls("colocated", None, 0, tp, workers, tp, budget, max_seqs)

    @property
    def gpus(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    def label(self) -> str:
        pools = (f"{self.decode}x{self.decode_tp}" if self.mode == "colocated" else
                 f"{self.prefill}x{self.prefill_tp} / {self.decode}x{self.decode_tp}")
        return f"{self.mode} {self.policy or '-'} {pools} budget {self.budget} seqs {self.max_seqs}"

    def cluster_spec(self, hw: Hardware) -> ClusterSpec:
        def pool(n: int, tp: int) -> PoolSpec:
            return PoolSpec(n, tp, self.max_seqs, self.budget, hw.sim_blocks(tp, self.max_seqs), hw.block_size)

        if self.mode == "colocated":
            return ClusterSpec("colocated", colocated=pool(self.decode, self.decode_tp),
                               link_bytes_per_s=hw.gpu.link_bytes_per_s)
        return ClusterSpec("disaggregated", prefill=pool(self.prefill, self.prefill_tp),
                           decode=pool(self.decode, self.decode_tp), disagg_policy=self.policy or "always",
                           link_bytes_per_s=hw.gpu.link_bytes_per_s)


@dataclass
class Outcome:
    """One configuration's rate search."""

    candidate: Candidate
    probes: list[dict] = field(default_factory=list)
    """{"rate", "attainment", "passed"} per simulated run."""
    max_rate: float | None = None
    bound: str = "none"
    """RateSearch.bound(): "bracketed", "lower" (the budget ran out going up) or "none"."""
    pruned: bool = False
    """Stopped after failing at the family's best rate per GPU: max_rate is below that."""

    @property
    def score(self) -> float:
        """Max rate per GPU (0 when none passed)."""
        return (self.max_rate or 0.0) / self.candidate.gpus

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self.candidate), "gpus": self.candidate.gpus, "max_rate": self.max_rate,
                "rate_per_gpu": self.score, "bound": self.bound, "pruned": self.pruned, "probes": self.probes}


@dataclass(frozen=True)
class Settings:
    """What is searched: at most ``num_gpus`` per configuration, these budgets
    (max_num_batched_tokens), batch limits (max_num_seqs, the first is the starting one) and
    modes ("colocated", and the disaggregated policies "always", "auto")."""

    num_gpus: int = 8
    budgets: tuple[int, ...] = (512, 2048, 8192)
    max_seqs: tuple[int, ...] = (256, 64)
    attainment: float = 0.9
    max_probes: int = 7
    modes: tuple[str, ...] = ("colocated", "always", "auto")


class PlanSearch:
    """Searches placements of ``workload`` (see the module's docstring)."""

    def __init__(self, workload: Workload, step_model: StepTimeModel, hw: Hardware, slo: dict[str, float],
                 settings: Settings = Settings(), on_probe: Callable[[Candidate, dict], None] | None = None) -> None:
        self.workload, self.step_model, self.hw, self.slo, self.settings = workload, step_model, hw, slo, settings
        self.on_probe = on_probe
        self.outcomes: dict[Candidate, Outcome] = {}

    # -- one configuration ------------------------------------------------------------------

    def probe(self, candidate: Candidate, rate: float, routing: str = "least_loaded") -> dict:
        """One simulated run of the workload at ``rate`` on ``candidate``, its router's
        policy ``routing``."""
        from tandem.sim.run import simulate  # torch: not at the command line's start

        spec = dataclasses.replace(candidate.cluster_spec(self.hw), routing_policy=routing)
        report = simulate(spec, self.workload.at_rate(rate), self.step_model, self.hw.shape, self.slo, self.hw.dtype)
        share = attainment(report.metrics)
        result = {"rate": rate, "attainment": share, "passed": share >= self.settings.attainment}
        logger.debug("%s @ %.3g req/s: %.0f%% within the SLO", candidate.label(), rate, 100 * share)
        if self.on_probe is not None:
            self.on_probe(candidate, result)
        return result

    def estimate(self, c: Candidate) -> float:
        """A first rate to probe: the roofline's service rate of the unit, taking a prompt
        alone and decodes in batches of up to 32."""
        m, p, o = self.step_model, self.workload.mean_prompt_len, self.workload.mean_output_len
        batch = min(32, c.max_seqs)
        prefill_s = m.step_s(int(p), 0, int(p), c.prefill_tp if c.prefill else c.decode_tp)
        decode_s = o * m.step_s(0, batch, int(batch * (p + o / 2)), c.decode_tp) / batch
        if c.mode == "colocated":
            return c.decode / (prefill_s + decode_s)
        return min(c.prefill / prefill_s, c.decode / decode_s)

    def burst_rate(self, c: Candidate) -> float:
        """The rate at which every request of the workload arrives within one unloaded
        request's time on ``c`` (its prompt alone, then its decode alone): above it a probe
        is a single burst, which a pool that batches the whole workload at once passes."""
        m, p, o = self.step_model, int(self.workload.mean_prompt_len), self.workload.mean_output_len
        alone_s = (m.step_s(p, 0, p, c.prefill_tp if c.prefill else c.decode_tp)
                   + o * m.step_s(0, 1, int(p + o / 2), c.decode_tp))
        return len(self.workload.requests) / alone_s

    def evaluate(self, c: Candidate, floor_rate: float | None = None) -> Outcome:
        """``c``'s highest passing rate; with ``floor_rate``, a first failure there stops it."""
        if c in self.outcomes:
            return self.outcomes[c]
        out = self.outcomes[c] = Outcome(c)
        search = RateSearch(round(floor_rate if floor_rate else self.estimate(c), 4))
        burst = self.burst_rate(c)
        for _ in range(self.settings.max_probes):
            rate = search.next_rate()
            passed = search.max_rate()
            if rate is None or (search.lowest_fail() is None and passed is not None and passed >= burst):
                break  # a pass where the whole workload is one burst: no higher probe finds a limit
            result = self.probe(c, rate)
            out.probes.append(result)
            search.record(rate, result["passed"])
            if floor_rate and len(out.probes) == 1 and not result["passed"]:
                out.pruned = True
                break
        out.max_rate, out.bound = search.max_rate(), search.bound()
        return out

    # -- the search -------------------------------------------------------------------------

    def best(self, family: Iterable[str]) -> Outcome | None:
        """The best-scoring outcome whose mode (colocated) or policy is in ``family``."""
        done = [o for o in self.outcomes.values()
                if (o.candidate.policy or o.candidate.mode) in family and o.max_rate is not None]
        return max(done, key=lambda o: o.score, default=None)

    def _try(self, c: Candidate, family: tuple[str, ...]) -> Outcome:
        incumbent = self.best(family)
        floor = incumbent.score * c.gpus if incumbent is not None else None
        return self.evaluate(c, floor)

    def _descend(self, start: Candidate, family: tuple[str, ...], tps: list[int]) -> None:
        """Budgets, batch limits, TP sizes, then the ratio, each from the best so far."""
        s = self.settings
        for budget in s.budgets:
            self._try(dataclasses.replace(start, budget=budget), family)
        base = self.best(family) or self.outcomes[start]
        for seqs in s.max_seqs:
            self._try(dataclasses.replace(base.candidate, max_seqs=seqs), family)
        base = self.best(family) or base
        if start.mode == "colocated":
            for tp in tps:
                self._try(dataclasses.replace(base.candidate, prefill_tp=tp, decode_tp=tp), family)
            return
        for tp_p, tp_d in itertools.product(tps, tps):
            c = dataclasses.replace(base.candidate, prefill_tp=tp_p, decode_tp=tp_d)
            if c.gpus <= s.num_gpus:
                self._try(c, family)
        self._climb_ratio(family, start.policy or "always")

    def _climb_ratio(self, family: tuple[str, ...], policy: str) -> None:
        """From ``policy``'s best, one more prefill or decode worker while that scores better
        (probes pruned against the whole family's best)."""
        while True:
            best = self.best((policy,))
            if best is None:
                return
            c = best.candidate
            steps = [dataclasses.replace(c, prefill=c.prefill + 1), dataclasses.replace(c, decode=c.decode + 1)]
            for step in steps:
                if step.gpus <= self.settings.num_gpus:
                    self._try(step, family)
            if self.best((policy,)) is best:
                return

    def run(self, extra: Iterable[Candidate] = ()) -> list[Outcome]:
        """Search every mode of the settings; ``extra`` configurations are searched in full
        (no pruning) first. -> every outcome, best score first."""
        s = self.settings
        tps = self.hw.fitting_tps(s.num_gpus)
        if not tps:
            raise ValueError(f"{self.hw.shape.name} ({self.hw.dtype}) does not fit {s.num_gpus} {self.hw.gpu.name} "
                             f"GPU(s) with room for a full-length sequence's KV")
        for c in extra:
            self.evaluate(c)
        tp0 = tps[0]
        if "colocated" in s.modes:
            self._descend(Candidate.colocated(1, tp0, s.budgets[0], s.max_seqs[0]), ("colocated",), tps)
        disagg = tuple(m for m in ("always", "auto") if m in s.modes)
        if "always" in s.modes and 2 * tp0 <= s.num_gpus:
            self._descend(Candidate("disaggregated", "always", 1, tp0, 1, tp0, s.budgets[0], s.max_seqs[0]),
                          disagg, tps)
        if "auto" in s.modes and 2 * tp0 <= s.num_gpus:
            best = self.best(disagg)
            start = (dataclasses.replace(best.candidate, policy="auto") if best is not None else
                     Candidate("disaggregated", "auto", 1, tp0, 1, tp0, s.budgets[0], s.max_seqs[0]))
            self._try(start, disagg)
            self._climb_ratio(disagg, "auto")
        return sorted(self.outcomes.values(), key=lambda o: o.score, reverse=True)

    def verify(self, unit: Outcome) -> tuple[Candidate, int, list[dict]]:
        """``unit`` repeated as often as the GPUs allow, as one cluster, probed at the unit's
        max rate × its copies under each of ROUTINGS until one passes -> (the cluster, the
        copies, the probes, each with its "routing"; none with one copy)."""
        k = max(1, self.settings.num_gpus // unit.candidate.gpus)
        cluster = dataclasses.replace(unit.candidate, prefill=unit.candidate.prefill * k,
                                      decode=unit.candidate.decode * k)
        checks: list[dict] = []
        if k > 1 and unit.max_rate is not None:
            for routing in ROUTINGS:
                checks.append({**self.probe(cluster, unit.max_rate * k, routing), "routing": routing})
                if checks[-1]["passed"]:
                    break
        return cluster, k, checks

