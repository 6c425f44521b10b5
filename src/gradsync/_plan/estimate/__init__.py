"""What deferring the gradient sync saves on a cluster, estimated before renting it (no torch).

For one optimizer step of k micro-steps on N data-parallel ranks, with G bytes of gradients
and P bytes of (gathered) parameters per model copy, each rank sends:

* DDP, ring all-reduce of the gradients:     2(N-1)/N * G per all-reduce
* FSDP2 / ZeRO, reduce-scatter of gradients:   (N-1)/N * G per reduce-scatter
* FSDP2 / ZeRO, all-gather of parameters:      (N-1)/N * P per all-gather

and a collective of B bytes sent per rank over C calls (buckets) takes ``C * latency +
B / bandwidth``, ``bandwidth`` being the bus bandwidth one rank gets (what nccl-tests calls
busbw). The step time is ``k * compute + optimizer + communication``, with no overlap of
communication and compute (an upper bound on what the communication costs; where the
backend hides some of it behind backward, deferral saves less). ``sync_ms`` replaces the
modelled time of one gradient sync by a measured one (the benchmark's in-step cost).

Per optimizer step, what each schedule issues:

=====================  =========================================  ==============================
backend / mode         per micro-step                             once per step
=====================  =========================================  ==============================
ddp naive              all-reduce G                               -
ddp defer              -                                          all-reduce G
fsdp naive             2 all-gathers P (forward, backward), RS G  -
fsdp defer             2 all-gathers P                            reduce-scatter G
fsdp defer + params    -                                          all-gather P, reduce-scatter G
zero2 naive (native)   reduce-scatter G                           all-gather P (updated params)
zero2 defer            -                                          reduce-scatter G, all-gather P
zero3 naive (native)   2 all-gathers P, reduce-scatter G          -
zero3 defer            2 all-gathers P                            reduce-scatter G
=====================  =========================================  ==============================

FSDP2 hybrid sharding (HSDP) on an R x S mesh (R replicas across nodes, S shards inside a
node) splits the traffic in two: the reduce-scatter of the gradients and the all-gathers of
the parameters run inside the shard group (in the node, ``intra_gbs``), and the reduced
shard, G/S bytes, is all-reduced across the R replicas (across nodes, ``inter_gbs``):
2(R-1)/R * G/S bytes per rank per all-reduce. Per optimizer step:

=====================  =========================================  ===========================
policy                 per micro-step                             once per step
=====================  =========================================  ===========================
every_step             2 all-gathers P, RS G, all-reduce G/S      -
defer_replicate        2 all-gathers P, RS G                      all-reduce G/S
defer                  2 all-gathers P                            RS G, all-reduce G/S
defer + params         -                                          all-gather P, RS G, AR G/S
=====================  =========================================  ===========================

and the gradient memory each rank holds beyond ``every_step``'s sharded gradients (G/S):
``defer_replicate`` the partial all-reduce buffer, G/S (its sharded ``.grad`` is set only at
the boundary, so at most G/S more); ``defer`` the unsharded gradients, G instead of G/S;
``defer + params`` those and the parameters kept gathered, P more (FSDP2 keeps each rank's
shard beside the gathered copy: benchmarks/hsdp_bytes.py measures G + P held before the boundary).

With tensor parallelism on a (dp_replicate R, dp_shard S, tp T) mesh (``estimate_mesh``), each
rank first holds 1/T of the TP-sharded weights (a share ``tp_share`` of the model; the rest,
norms and biases a plan leaves whole, is replicated over the TP group), and FSDP2 shards that
over S: per rank, G_T = G x (tp_share / T + 1 - tp_share) gradient bytes and P_T likewise
before the 1/S. The data-parallel rows above then hold with G_T and P_T in place of G and P:
reduce-scatter and all-gathers in the dp_shard group, the all-reduce of G_T/S across
dp_replicate. The TP group's own traffic (the activations of colwise/rowwise layers in
forward and backward) depends on the model, not on the gradients: it runs on every micro-step
under every policy, since it is the computation itself; given ``tp_bytes`` per micro-step it
is k x that per step, else it is reported as model-dependent. ``deferral_bytes`` is what a
policy holds that ``auto`` weighs against its budget, as the FSDP adapter counts it
(``backend.memory["deferral_extra_bytes"]``): ``defer`` G_T - G_T/S, ``defer + params``
G_T - G_T/S + P_T, ``defer_replicate`` its partial buffer G_T/S, ``every_step`` 0;
``auto`` takes the first of defer + params, defer, defer_replicate (R > 1) that fits the
budget, else every_step. ``extra_memory`` is what the window holds beyond every_step's as
benchmarks/hsdp_bytes.py measures it: the gradients above G_T/S, and for kept parameters
the whole gathered copy P_T, since FSDP2 keeps each rank's shard beside it (the adapter
counts it so too); ``defer_replicate``'s partial buffer takes the place of
the sharded gradients (0 more).

With a pipeline (pp = P, outermost) each stage is counted as an even 1/P of the model: G_T
and P_T are divided by P. The pipeline's own traffic, the activations to the next stage and
their gradients back, runs on every micro-step under every policy: given
``pp_activation_bytes`` A per micro-step the busiest rank sends k x A per step with two
stages, 2k x A with more (with V stages per rank, (2V-1) k x A and 2V k x A); else it is
reported as model-dependent. A schedule step of ``pp_microbatches`` M parts idles each rank
for the bubble, (P-1)/(M+P-1) of it (GPipe, 1F1B; Interleaved1F1B: (P-1)/(V M+P-1)): the
step time counts ``compute_ms`` (a stage's busy time per micro-step) / (1 - bubble). Given
``pp_saved_activation_bytes``, what a rank's stages save for backward for one part, the first stage
holds the parts its schedule keeps in flight times that at its peak (GPipe M, 1F1B P,
_pipeline.py says how many for each rank), beside its gradients, parameters and
``optimizer_state_bytes`` per parameter of optimizer state.
"""

from __future__ import annotations

from gradsync._plan.estimate._flat import BACKENDS, Cluster, Row, estimate, format_table
from gradsync._plan.estimate._hybrid import (
    HYBRID_POLICIES,
    INTER_GBS,
    INTRA_GBS,
    HybridCluster,
    HybridRow,
    estimate_hybrid,
    format_hybrid,
    hybrid_mesh,
)
from gradsync._plan.estimate._mesh import (
    MeshCluster,
    MeshRow,
    auto_policy,
    estimate_mesh,
    format_mesh,
)

__all__ = [
    "BACKENDS",
    "HYBRID_POLICIES",
    "INTER_GBS",
    "INTRA_GBS",
    "Cluster",
    "HybridCluster",
    "HybridRow",
    "MeshCluster",
    "MeshRow",
    "Row",
    "auto_policy",
    "estimate",
    "estimate_hybrid",
    "estimate_mesh",
    "format_hybrid",
    "format_mesh",
    "format_table",
    "hybrid_mesh",
]
