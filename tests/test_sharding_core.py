"""Policy, plan, mesh, the three layouts and the pre-flight check on 8 simulated devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pydantic
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from theseus.accounting.preflight import BatchPlan
from theseus.sharding.axis import Axis, ShardingPlan, ShardingPolicy, partition_spec
from theseus.sharding.layout import (
    LayoutError,
    abstract_leaves,
    check_layouts,
    optimizer_layout,
    resolve_layouts,
)
from theseus.sharding.topology import Topology

ATTN_PLAN = ShardingPlan(tp=[("n_embd", None), ("n_attn", Axis.SHARD)])


def annotated(shape, names):
    value = jax.ShapeDtypeStruct(shape, jnp.float32)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def spec_example_state():
    return {"attn": {"kernel": annotated((1024, 4096), ("n_embd", "n_attn"))}}


def per_device_shapes(shardings, shape):
    """Place a real array with ``shardings`` and return the shape of every addressable shard."""
    array = jax.device_put(np.zeros(shape, np.float32), shardings)
    return {tuple(s.data.shape) for s in array.addressable_shards}, len(array.addressable_shards)


# --- policy --------------------------------------------------------------------------------


def test_policy_defaults_and_validation():
    policy = ShardingPolicy()
    assert (policy.tp, policy.zero, policy.fsdp, policy.activation_checkpointing) == (
        1,
        True,
        False,
        "none",
    )
    # Recompute policies; the switch it was reads as full / none (older chains and checkpoints).
    assert ShardingPolicy(activation_checkpointing=True).activation_checkpointing == "full"
    assert ShardingPolicy(activation_checkpointing=False).activation_checkpointing == "none"
    assert ShardingPolicy(activation_checkpointing="dots").activation_checkpointing == "dots"
    with pytest.raises(pydantic.ValidationError, match="none, full, dots"):
        ShardingPolicy(activation_checkpointing="some")
    with pytest.raises(pydantic.ValidationError, match="FSDP requires ZeRO"):
        ShardingPolicy(fsdp=True, zero=False)
    with pytest.raises(pydantic.ValidationError, match="tp"):
        ShardingPolicy(tp=0)
    with pytest.raises(pydantic.ValidationError, match="extra"):
        ShardingPolicy(pipeline=2)
    with pytest.raises(pydantic.ValidationError, match="tp"):
        ShardingPolicy(tp="2")
    with pytest.raises(pydantic.ValidationError):
        ShardingPolicy(fsdp="yes")
    with pytest.raises(pydantic.ValidationError):
        policy.tp = 4  # frozen


def test_policy_merge_keeps_earlier_choices():
    merged = ShardingPolicy().merge(tp=2).merge(fsdp=True)
    assert (merged.tp, merged.zero, merged.fsdp) == (2, True, True)
    with pytest.raises(pydantic.ValidationError, match="FSDP requires ZeRO"):
        merged.merge(zero=False)


# --- plan and rule resolution --------------------------------------------------------------


def test_default_zero_rules_follow_tp_names():
    plan = ShardingPlan(tp=[("n_attn", "shard"), ("n_embd", None)])
    assert plan.zero == (("n_attn", "batch"),)
    assert dict(plan.merged()) == {"n_attn": ("shard", "batch"), "n_embd": None}


def test_rules_per_phase():
    plan = ATTN_PLAN
    tp_rules = plan.tp
    merged = plan.merged()
    cases = {
        ShardingPolicy(zero=False): (tp_rules, tp_rules, tp_rules),
        ShardingPolicy(): (tp_rules, tp_rules, merged),
        ShardingPolicy(fsdp=True): (tp_rules, merged, merged),
    }
    for policy, expected in cases.items():
        got = tuple(plan.rules(policy, phase) for phase in ("compute", "storage", "update"))
        assert got == expected, policy


def test_partition_spec_resolution():
    rules = [("a", ("shard", "batch")), ("b", "batch"), ("c", "shard")]
    assert partition_spec(("a", "b"), rules) == P(("shard", "batch"), None)
    assert partition_spec(("b", "c"), rules) == P("batch", "shard")
    assert partition_spec(("c", "a"), rules) == P("shard", "batch")
    assert partition_spec(("x", None), rules) == P(None, None)
    assert partition_spec(None, rules) == P()


def test_plan_rejects_bad_rules():
    with pytest.raises(ValueError, match="twice"):
        ShardingPlan(tp=[("a", "shard"), ("a", None)])
    with pytest.raises(ValueError, match="mesh axes"):
        ShardingPlan(tp=[("a", "model")])
    with pytest.raises(TypeError, match="pair"):
        ShardingPlan(tp=["a"])


def test_explicit_zero_rules_vocab():
    """GPT's shape of plan: vocab whole for TP, over batch for ZeRO."""
    plan = ShardingPlan(
        tp=[("vocab", None), ("n_embd", None), ("n_attn", "shard")],
        zero=[("vocab", "batch"), ("n_attn", "batch")],
    )
    topology = Topology.new(ShardingPolicy(tp=2, fsdp=True))
    state = {"wte": annotated((64, 96), ("vocab", "n_embd"))}
    layouts = resolve_layouts(state, plan, topology.policy, topology.mesh)
    assert layouts.compute["wte"].spec == P(None, None)
    assert layouts.storage["wte"].spec == P("batch", None)
    assert layouts.update["wte"].spec == P("batch", None)
    shapes, _ = per_device_shapes(layouts.storage["wte"], (64, 96))
    assert shapes == {(16, 96)}
    without_fsdp = resolve_layouts(state, plan, ShardingPolicy(tp=2), topology.mesh)
    assert without_fsdp.storage["wte"].spec == P(None, None)
    assert without_fsdp.update["wte"].spec == P("batch", None)


# --- topology ------------------------------------------------------------------------------


@pytest.mark.parametrize("tp,shape", [(1, (8, 1)), (2, (4, 2)), (4, (2, 4)), (8, (1, 8))])
def test_mesh_shapes(tp, shape):
    topology = Topology.new(ShardingPolicy(tp=tp))
    assert topology.mesh.axis_names == ("batch", "shard")
    assert tuple(topology.mesh.devices.shape) == shape
    assert topology.replicas == shape[0]
    assert topology.local_replicas == shape[0]
    assert topology.num_processes == 1
    assert all(t == jax.sharding.AxisType.Auto for t in topology.mesh.axis_types)
    ids = [d.id for d in topology.mesh.devices.flat]
    assert ids == sorted(ids)


def test_tp_must_divide_local_devices():
    with pytest.raises(ValueError, match=r"tp=3 does not divide the 8 local devices"):
        Topology.new(ShardingPolicy(tp=3))
    with pytest.raises(ValueError, match=r"tp=4 does not divide the 6 local devices"):
        Topology.new(ShardingPolicy(tp=4), devices=jax.devices()[:6])


def test_topology_orders_given_devices():
    devices = list(reversed(jax.devices()[:4]))
    topology = Topology.new(ShardingPolicy(tp=2), devices=devices)
    assert [d.id for d in topology.mesh.devices.flat] == sorted(d.id for d in devices)
    assert tuple(topology.mesh.devices.shape) == (2, 2)


def global_batch_size(topology: Topology, per_device_batch_size: int, accumulation: int) -> int:
    plan = BatchPlan(per_device_batch_size, topology.replicas, accumulation, seq_len=16)
    return plan.global_batch_size


def test_batch_accounting():
    topology = Topology.new(ShardingPolicy(tp=2))
    assert global_batch_size(topology, per_device_batch_size=2, accumulation=8) == 64
    assert global_batch_size(Topology.new(ShardingPolicy(tp=4)), 2, 8) == 32


# --- layouts -------------------------------------------------------------------------------


def test_specification_example_specs_and_shards():
    mesh = Topology.new(ShardingPolicy(tp=2)).mesh
    state = spec_example_state()
    expected = {
        # policy: (compute, storage, update) per-device shard shapes
        ShardingPolicy(tp=2): ((1024, 2048), (1024, 2048), (1024, 512)),
        ShardingPolicy(tp=2, fsdp=True): ((1024, 2048), (1024, 512), (1024, 512)),
        ShardingPolicy(tp=2, zero=False): ((1024, 2048), (1024, 2048), (1024, 2048)),
    }
    for policy, shard_shapes in expected.items():
        layouts = resolve_layouts(state, ATTN_PLAN, policy, mesh)
        for phase, shard_shape in zip(("compute", "storage", "update"), shard_shapes, strict=True):
            sharding = layouts[phase]["attn"]["kernel"]
            assert isinstance(sharding, NamedSharding)
            shapes, count = per_device_shapes(sharding, (1024, 4096))
            assert shapes == {shard_shape}, (policy, phase)
            assert count == 8
    layouts = resolve_layouts(state, ATTN_PLAN, ShardingPolicy(tp=2, fsdp=True), mesh)
    assert layouts.compute["attn"]["kernel"].spec == P(None, "shard")
    assert layouts.storage["attn"]["kernel"].spec == P(None, ("shard", "batch"))
    assert layouts.update["attn"]["kernel"].spec == P(None, ("shard", "batch"))


def test_dimension_over_both_axes_has_eight_distinct_pieces():
    mesh = Topology.new(ShardingPolicy(tp=2)).mesh
    layouts = resolve_layouts(spec_example_state(), ATTN_PLAN, ShardingPolicy(tp=2), mesh)
    sharding = layouts.update["attn"]["kernel"]
    values = np.arange(1024 * 4096, dtype=np.float32).reshape(1024, 4096)
    array = jax.device_put(values, sharding)
    starts = sorted(s.index[1].start for s in array.addressable_shards)
    assert starts == [512 * k for k in range(8)]
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), values[shard.index])
    # TP axis first: the two devices of one replica hold neighbouring halves of the TP slice.
    row = mesh.devices[0]
    by_device = {s.device: s.index[1].start for s in array.addressable_shards}
    assert by_device[row[1]] - by_device[row[0]] == 2048


def test_unannotated_arrays_stay_replicated():
    mesh = Topology.new(ShardingPolicy(tp=2)).mesh
    state = {"bias": jax.ShapeDtypeStruct((96,), jnp.float32), "scale": nnx.Param(jnp.ones(10))}
    for policy in (ShardingPolicy(), ShardingPolicy(tp=2, fsdp=True), ShardingPolicy(zero=False)):
        layouts = resolve_layouts(state, ATTN_PLAN, policy, mesh)
        for phase in ("compute", "storage", "update"):
            for sharding in jax.tree.leaves(layouts[phase]):
                assert sharding.spec == P()
                assert sharding.is_fully_replicated


def test_nnx_eval_shape_state_is_an_abstract_state():
    class Tiny(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.normal(), ("n_embd", "n_attn"))
            self.kernel = nnx.Param(init(rngs.params(), (16, 24)))
            self.bias = nnx.Param(jnp.zeros((24,)))

    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Tiny(nnx.Rngs(0)))
    leaves, _ = abstract_leaves(nnx.state(model))
    by_path = {leaf.path: leaf for leaf in leaves}
    assert by_path["kernel"].names == ("n_embd", "n_attn")
    assert by_path["kernel"].shape == (16, 24)
    assert by_path["bias"].names is None
    mesh = Topology.new(ShardingPolicy(tp=2)).mesh
    layouts = resolve_layouts(nnx.state(model), ATTN_PLAN, ShardingPolicy(tp=2, fsdp=True), mesh)
    assert layouts.storage["kernel"].spec == P(None, ("shard", "batch"))


def test_optimizer_state_follows_update_layout():
    policy = ShardingPolicy(tp=2)
    mesh = Topology.new(policy).mesh
    state = {"kernel": annotated((16, 24), ("n_embd", "n_attn")), "bias": annotated((24,), None)}
    params = {k: v.get_value() for k, v in state.items()}
    update = resolve_layouts(state, ATTN_PLAN, policy, mesh).update
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_layout = optimizer_layout(optimizer, opt_state, update, mesh)
    adam = opt_layout[1][0]
    assert adam.mu["kernel"].spec == P(None, ("shard", "batch"))
    assert adam.nu["kernel"].spec == P(None, ("shard", "batch"))
    assert adam.mu["bias"].spec == P()
    assert adam.count.spec == P()
    assert jax.tree.structure(opt_state) == jax.tree.structure(opt_layout)


# --- pre-flight check ----------------------------------------------------------------------


def test_check_passes_for_divisible_layout():
    mesh = Topology.new(ShardingPolicy(tp=2)).mesh
    check_layouts(spec_example_state(), ATTN_PLAN, ShardingPolicy(tp=2, fsdp=True), mesh)


def test_check_names_every_offending_leaf():
    policy = ShardingPolicy(tp=2, fsdp=True)
    mesh = Topology.new(policy).mesh
    plan = ShardingPlan(tp=[("n_attn", "shard"), ("vocab", None)], zero=[("n_attn", "batch")])
    state = {
        "blocks": {"proj": annotated((6, 4096), ("n_attn", "n_embd"))},
        "head": annotated((1024, 1030), ("n_embd", "n_attn")),
        "fine": annotated((16, 4096), ("n_attn", "n_embd")),
    }
    with pytest.raises(LayoutError) as failure:
        check_layouts(state, plan, policy, mesh)
    message = str(failure.value)
    assert "blocks/proj: shape (6, 4096)" in message
    assert "head: shape (1024, 1030)" in message
    assert "P(('shard', 'batch'), None)" in message
    assert "P(None, ('shard', 'batch'))" in message
    assert "batch=4, shard=2" in message
    assert "fine" not in message
    assert "pad" in message
    assert {p.leaf.path for p in failure.value.problems} == {"blocks/proj", "head"}
    # Without FSDP and ZeRO the TP split alone divides both.
    check_layouts(state, plan, ShardingPolicy(tp=2, zero=False), mesh)


def test_check_rejects_wrong_number_of_names():
    mesh = Topology.new(ShardingPolicy()).mesh
    state = {"w": annotated((8, 8), ("n_attn",))}
    with pytest.raises(LayoutError, match="1 logical names for a tensor of rank 2"):
        check_layouts(state, ATTN_PLAN, ShardingPolicy(), mesh)
