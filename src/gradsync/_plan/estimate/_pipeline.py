"""The pipeline's part of the mesh estimate: the bubble of a schedule step and the activations
a stage holds at its peak, for the schedules ``pp_schedule`` names (no torch).

With P stages, M parts (``pp_microbatches``) per micro-step and V stages per rank
(``pp_stages_per_rank``, Interleaved1F1B only), each rank is idle for a share of a schedule
step, the bubble:

* GPipe and 1F1B: (P-1)/(M+P-1): the pipeline fills and drains once per schedule step, P-1
  part-slots out of M+P-1 on every rank;
* Interleaved1F1B: (P-1)/(V*M+P-1): a part-slot of one of V stages is 1/V as long, so the
  fill and the drain are V times shorter against the same work.

A stage keeps the tensors autograd saved for a part's backward from that part's forward to
its backward. At its peak a rank holds:

* GPipe: all M parts (every forward runs before the first backward);
* 1F1B: min(M, P - s) parts on stage s (s forwards fewer the further down the pipeline; P on
  the first stage);
* Interleaved1F1B, as torch schedules it: rank r runs w = min((V-1) x m_r + 2(P-1-r), V x M)
  forwards of its stages before its first backward (m_r = M // max(1, M // P), the parts of a
  round), then one forward before each backward: min(w + 1, V x M) stage-parts, each 1/V of
  the rank's share of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradsync.errors import ConfigError

#: The schedules the estimate knows, as ``pp_schedule`` names them.
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


@dataclass(frozen=True)
class Schedule:
    """One schedule step of a pipeline: P stages, M parts, V stages per rank."""

    stages: int  # P
    name: str = "1F1B"
    microbatches: int | None = None  # M; None: P
    per_rank: int = 1  # V

    @property
    def parts(self) -> int:
        return self.stages if self.microbatches is None else self.microbatches

    def check(self) -> Schedule:
        """One ConfigError line for a schedule torch would not run, before anything else."""
        if self.name not in SCHEDULES:
            raise ConfigError(
                f"pp_schedule={self.name!r} is no schedule; use one of {', '.join(SCHEDULES)}"
            )
        for name, value in (("pp_microbatches", self.parts), ("pp_stages_per_rank", self.per_rank)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be an integer >= 1")
        if self.stages > 1 and self.parts < self.stages:
            raise ConfigError(
                f"pp_microbatches={self.parts} is fewer than the pp={self.stages} stages: the "
                f"schedules need at least one part per stage; give pp_microbatches >= {self.stages}"
            )
        if (self.per_rank > 1) != (self.name == "Interleaved1F1B") and self.stages > 1:
            raise ConfigError(
                f"pp_stages_per_rank={self.per_rank} needs pp_schedule='Interleaved1F1B', not "
                f"{self.name!r}"
                if self.per_rank > 1
                else "pp_schedule='Interleaved1F1B' runs several stages on each rank, and "
                "pp_stages_per_rank=1; give pp_stages_per_rank >= 2"
            )
        if self.name == "Interleaved1F1B" and self.parts % self._rounds():
            raise ConfigError(
                f"pp_microbatches={self.parts} is no multiple of its {self._rounds()} rounds "
                f"(pp_microbatches // pp={self.stages}): Interleaved1F1B runs whole rounds"
            )
        return self

    def _rounds(self) -> int:
        return max(1, self.parts // self.stages)

    def bubble(self) -> float:
        """The idle share of a schedule step on every rank: (P-1)/(V x M + P-1)."""
        p = self.stages
        return (p - 1) / (self.per_rank * self.parts + p - 1)

    def formula(self) -> str:
        return "(P-1)/(V*M+P-1)" if self.per_rank > 1 else "(P-1)/(M+P-1)"

    def parts_held(self, rank: int) -> float:
        """The parts whose saved activations rank ``rank`` (its pipeline coordinate) holds at
        its peak, in units of one part through the rank's whole share of the model."""
        p, m, v = self.stages, self.parts, self.per_rank
        if p == 1:
            return 1.0
        if self.name == "GPipe":
            return float(m)
        if self.name == "1F1B":
            return float(min(m, p - rank))
        per_round = m // self._rounds()
        warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), v * m)
        return min(warmup + 1, v * m) / v

    def held_by_rank(self) -> list[float]:
        return [self.parts_held(r) for r in range(self.stages)]

    def sends(self) -> int:
        """The busiest rank's sends to its neighbours per part, in units of one stage's
        activations: each stage but the last sends its output forward, each but the first
        the gradient of its input back; with two ranks none holds both ends' inner sides."""
        v = self.per_rank
        return 2 * v - 1 if self.stages == 2 else 2 * v
