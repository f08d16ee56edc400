"""The policies a mesh allows, and the communication order used to choose between them.

Per step, with Ψ parameters and gradients of 4Ψ bytes, a ring collective moves about (N−1)/N of
its buffer per device:

1. DP (``zero=False``): the gradients are all-reduced over ``batch`` — the baseline.
2. ZeRO: the same gradient reduction, then each replica updates its slice and the updated
   parameters are all-gathered back to the replicated storage layout: one parameter all-gather
   more than DP.
3. FSDP: stored parameters are gathered over ``batch`` to run every microbatch (forward, and
   again in backward unless kept), and gradients are reduce-scattered: about 1.5× ZeRO's volume
   (the ZeRO paper's 3Ψ against 2Ψ), growing with accumulation steps.
4. Any ``tp > 1``: activations are combined inside every layer, forward and backward, for every
   microbatch; this scales with tokens rather than parameters and is latency-bound, so every TP
   policy ranks after every ``tp=1`` policy, smaller ``tp`` first, and within one ``tp`` the
   order DP < ZeRO < FSDP above.
"""

from __future__ import annotations

from theseus.sharding.axis import EXPERT_AXES, Placement, Remat, ShardingPolicy, token_exchange
from theseus.sharding.topology import resolve_devices_per_host

COMMUNICATION = {
    "DP": "all-reduce gradients over batch",
    "ZeRO": "DP + all-gather updated parameters over batch",
    "FSDP": "ZeRO + gather parameters over batch for every microbatch",
}


def expert_exchange(policy: ShardingPolicy) -> str:
    """What placing a mixture's experts adds to the communication, by the exchange the layout
    gets (:func:`theseus.sharding.axis.token_exchange`): over ``batch`` (or both) each expert
    layer sends every replica's tokens to the experts' devices and the outputs back by
    all-to-all; over ``shard`` each device runs its experts on the replica's tokens and the
    outputs are summed over ``shard``. Empty when the experts are not placed."""
    if policy.experts == "none":
        return ""
    axes = " and ".join(EXPERT_AXES[policy.experts])
    text = f"; experts split over {axes}: each expert layer "
    if token_exchange(policy.experts) == "all-to-all":
        text += "sends tokens to their experts and the outputs back by all-to-all over batch"
        return text + (", then all-reduces them over shard" if policy.experts == "both" else "")
    return (
        text
        + "runs each device's experts on the replica's tokens and all-reduces the outputs over shard"
    )


def communication(policy: ShardingPolicy) -> str:
    text = COMMUNICATION[policy.kind]
    if policy.tp > 1:
        text = f"{text}; activations within every layer over tp={policy.tp}"
    return text + expert_exchange(policy)


def communication_key(policy: ShardingPolicy) -> tuple[int, int]:
    """Sort key of the communication order: tp first, then DP < ZeRO < FSDP."""
    return policy.tp, tuple(COMMUNICATION).index(policy.kind)


def candidate_policies(
    num_devices: int,
    devices_per_host: int | None = None,
    *,
    activation_checkpointing: Remat = "none",
    experts: Placement = "none",
) -> list[ShardingPolicy]:
    """Every policy the mesh allows, least communication first: each ``tp`` dividing the devices
    of one host, with DP, ZeRO and FSDP (each recomputing and placing experts as given)."""
    per_host = resolve_devices_per_host(num_devices, devices_per_host)
    policies = [
        ShardingPolicy(
            tp=tp,
            zero=zero,
            fsdp=fsdp,
            activation_checkpointing=activation_checkpointing,
            experts=experts,
        )
        for tp in range(1, per_host + 1)
        if per_host % tp == 0
        for zero, fsdp in ((False, False), (True, False), (True, True))
    ]
    return sorted(policies, key=communication_key)
