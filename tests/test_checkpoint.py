"""Checkpoints: reshard on restore, keep-last-K, metadata, parameters alone, and damaged or
foreign checkpoints."""

import glob
import json
import os
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support import (
    EQUIVALENCE_BATCH,
    EQUIVALENCE_MODEL,
    GPTTrainer,
    equivalence_config,
    log_lines,
    shared_trainer,
    step_batch,
)

from theseus.accounting.records import as_json
from theseus.checkpoint.budget import limit, write_requests
from theseus.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointError,
    IncompatibleCheckpointError,
    fingerprints,
)
from theseus.checkpoint.fingerprints import device_fingerprints
from theseus.checkpoint.meta import CheckpointMeta
from theseus.sharding.axis import ShardingPolicy
from theseus.sharding.layout import path_str
from theseus.sharding.topology import Topology
from theseus.training.run.checkpointing import checkpoint_meta, restore_target
from theseus.training.state import TrainState

MODEL = EQUIVALENCE_MODEL
GLOBAL_BATCH = EQUIVALENCE_BATCH
SAVED_POLICY = ShardingPolicy(tp=2, fsdp=True)


def make_trainer(policy, per_device_batch_size, num_devices=8, model=MODEL) -> GPTTrainer:
    config = equivalence_config(per_device_batch_size, model)
    return shared_trainer(config, policy, num_devices=num_devices)


batch = step_batch


def host(tree):
    return jax.tree.leaves(jax.device_get(tree))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two steps under tp=2 + FSDP on 8 devices, saved after each (async); then a third step.

    The third step donates the state right after the save returns, so the checkpoint must hold
    the values as they were at ``save``.
    """
    directory = tmp_path_factory.mktemp("run") / "checkpoints"
    trainer = make_trainer(SAVED_POLICY, per_device_batch_size=2)  # 4 replicas, accumulation 4
    assert trainer.batch_plan.accumulation_steps == 4
    state = trainer.init_state()
    checkpointer = Checkpointer(directory, keep=3, async_save=True)
    for index in range(2):
        state, _ = trainer.train_step(state, batch(trainer, index))
        step = index + 1
        checkpointer.save(
            state, checkpoint_meta(trainer, step=step, data_position=step * GLOBAL_BATCH)
        )
    # A device-side copy: reading the state to the host here would give numpy views of the CPU
    # buffers, and XLA does not donate buffers that have outside references.
    saved_copy, saved_arrays = jax.tree.map(jnp.copy, state), jax.tree.leaves(state)
    state, metrics = trainer.train_step(state, batch(trainer, 2))
    assert all(array.is_deleted() for array in saved_arrays)  # donated while the save runs
    checkpointer.wait()
    saved_state = host(saved_copy)
    checkpointer.close()
    return {
        "directory": directory,
        "trainer": trainer,
        "state": saved_state,
        "next_loss": float(metrics["loss"]),
    }


def damaged_copy(saved, tmp_path):
    directory = tmp_path / "checkpoints"
    shutil.copytree(saved["directory"], directory)
    return directory


def data_files(directory, step):
    """Array data files of one step, largest first."""
    files = glob.glob(str(directory / str(step) / "state" / "**" / "d" / "*"), recursive=True)
    assert files, f"no data files under {directory / str(step)}"
    return sorted(files, key=os.path.getsize, reverse=True)


def assert_follows(state, target):
    """Every restored array has the target's layout: same devices, same shard shapes."""
    for (path, array), want in zip(
        jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(target), strict=True
    ):
        assert array.shape == want.shape, path
        assert array.sharding.is_equivalent_to(want.sharding, array.ndim), path
        shard_shapes = {tuple(s.data.shape) for s in array.addressable_shards}
        assert shard_shapes == {want.sharding.shard_shape(want.shape)}, path
        assert array.sharding.device_set == want.sharding.device_set, path


# --- reshard on restore --------------------------------------------------------------------------

TARGETS = {
    "tp1-nozero-4devices": (ShardingPolicy(tp=1, zero=False), 8, 4),  # 4 replicas, accumulation 1
    "tp4-8devices": (ShardingPolicy(tp=4), 4, 8),  # 2 replicas, accumulation 4
}


@pytest.mark.parametrize("name", TARGETS)
def test_restore_reshards_and_training_continues(saved, name):
    policy, per_device, num_devices = TARGETS[name]
    trainer = make_trainer(policy, per_device, num_devices)
    target = restore_target(trainer)
    with Checkpointer(saved["directory"]) as checkpointer:
        assert checkpointer.latest_step() == 2
        restored = checkpointer.restore_state(None, target)
        assert checkpointer.skipped == ()
    state, meta = restored.state, restored.meta

    for got, want in zip(host(state), saved["state"], strict=True):
        np.testing.assert_array_equal(got, want)
    assert_follows(state, target)
    assert int(state.step) == 2

    # What was saved is what the saving run described.
    assert meta == checkpoint_meta(saved["trainer"], step=2, data_position=2 * GLOBAL_BATCH)
    assert meta.policy == SAVED_POLICY.model_dump()
    assert meta.mesh_shape == {"batch": 4, "shard": 2}
    assert meta.num_devices == 8
    assert meta.config == saved["trainer"].config.model_dump(mode="json")

    # The math does not depend on the layout: the third step agrees with the saving run's.
    _, metrics = trainer.train_step(state, batch(trainer, 2))
    np.testing.assert_allclose(float(metrics["loss"]), saved["next_loss"], rtol=1e-5)


# --- keep-last-K, latest step, metadata ----------------------------------------------------------


def tiny_state(seed: int) -> TrainState:
    key = jax.random.PRNGKey(seed)
    params = {"w": jax.random.normal(key, (8, 4)), "b": jnp.arange(4, dtype=jnp.float32) + seed}
    return TrainState(params, (jnp.zeros((8, 4)),), jnp.asarray(seed, jnp.int32), key)


def tiny_meta(step: int, data_position: int = 0) -> CheckpointMeta:
    """Metadata of a tiny state: a config of its own, one device."""
    one = dict.fromkeys(
        ("num_devices", "num_processes", "replicas", "per_device_batch_size"), 1
    ) | {"accumulation_steps": 1, "global_batch_size": 1, "seq_len": 1}
    return CheckpointMeta(
        step=step,
        data_position=data_position,
        config={"note": [1, "x"]},
        policy={},
        mesh_shape={"batch": 1},
        **one,
    )


def test_keep_last_k_latest_step_and_metadata(tmp_path):
    directory = tmp_path / "checkpoints"
    with Checkpointer(directory, keep=2) as checkpointer:
        assert checkpointer.latest_step() is None
        with pytest.raises(CheckpointError, match="no checkpoints in"):
            checkpointer.restore_state(None, tiny_state(0))
        for step in (10, 20, 30, 40):
            checkpointer.save(tiny_state(step), tiny_meta(step, data_position=step * 3))
        checkpointer.wait()
        assert checkpointer.all_steps() == [30, 40]
        assert checkpointer.latest_step() == 40
    assert sorted(os.listdir(directory)) == ["30", "40"]

    with Checkpointer(directory, keep=2) as reopened:
        assert reopened.all_steps() == [30, 40]
        one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one_device),
            jax.eval_shape(lambda: tiny_state(0)),
        )
        restored = reopened.restore_state(30, target)
        assert restored.meta == tiny_meta(30, data_position=90) and restored.step == 30
        for got, want in zip(host(restored.state), host(tiny_state(30)), strict=True):
            np.testing.assert_array_equal(got, want)
        with pytest.raises(CheckpointError, match=r"step 20\) does not exist"):
            reopened.restore_state(20, tiny_state(0))
        # Steps behind the newest would mix two timelines: refused, naming the directory.
        with pytest.raises(CheckpointError, match="already holds step"):
            reopened.save(tiny_state(35), tiny_meta(35))


def test_checkpoint_meta_describes_the_run(saved):
    trainer = saved["trainer"]
    meta = checkpoint_meta(trainer, step=3, data_position=96)
    assert ShardingPolicy(**meta.policy) == SAVED_POLICY
    assert meta.mesh_shape == {"batch": 4, "shard": 2}
    assert meta.num_devices == 8
    assert meta.data_position == 96
    assert meta.step == 3
    assert meta.config["model"]["n_embd"] == MODEL.n_embd
    # Written and read as JSON by one function each; anything else is refused by name.
    assert CheckpointMeta.from_json(json.loads(json.dumps(as_json(meta)))) == meta
    with pytest.raises(ValueError, match=r"missing keys: \['data_position'\]"):
        CheckpointMeta.from_json({k: v for k, v in as_json(meta).items() if k != "data_position"})
    with pytest.raises(ValueError, match="metadata step must be at least 0, got -1"):
        CheckpointMeta.from_json({**as_json(meta), "step": -1})


def test_fingerprints_ignore_layout_and_see_one_bit():
    x = jax.random.normal(jax.random.PRNGKey(0), (16, 8))
    mesh = Topology.new(ShardingPolicy(tp=2)).mesh
    spec = jax.sharding.PartitionSpec("batch", "shard")
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
    assert fingerprints({"x": x}) == fingerprints({"x": sharded})
    flipped = jax.lax.bitcast_convert_type(x, jnp.uint32).at[3, 5].add(1)
    flipped = jax.lax.bitcast_convert_type(flipped, jnp.float32)
    assert fingerprints({"x": flipped}) != fingerprints({"x": x})
    assert fingerprints({"x": x.T}) != fingerprints({"x": x})


# --- damaged checkpoints -------------------------------------------------------------------------


def _garble(path, num_bytes=1):
    path = Path(path)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, min(middle + num_bytes, len(data))):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def _truncate(path):
    path = Path(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGE = {
    "data-file-deleted": lambda d: os.remove(data_files(d, 2)[0]),
    "data-file-truncated": lambda d: _truncate(data_files(d, 2)[0]),
    # Orbax reads garbled data silently; the fingerprints catch it.
    "one-data-byte-flipped": lambda d: _garble(data_files(d, 2)[0]),
    "metadata-garbage": lambda d: (d / "2" / "meta" / "metadata").write_text("{not json"),
    "state-dir-deleted": lambda d: shutil.rmtree(d / "2" / "state"),
}


# When one read of a damaged step fails, orbax abandons its sibling reads; their coroutines are
# reported as unraisable exceptions at garbage collection. Orbax's noise, not ours.
orbax_abandoned_reads = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning"
)


@orbax_abandoned_reads
@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_latest_falls_back_to_previous(saved, tmp_path, damage):
    directory = damaged_copy(saved, tmp_path)
    DAMAGE[damage](directory)
    trainer = saved["trainer"]
    target = restore_target(trainer)
    messages = []
    with log_lines(messages.append), Checkpointer(directory) as checkpointer:
        assert checkpointer.latest_step() == 2
        with pytest.raises(CheckpointError) as error:
            checkpointer.restore_state(2, target)
        assert not isinstance(error.value, IncompatibleCheckpointError)
        assert f"{directory / '2'} (step 2) is damaged" in str(error.value)

        restored = checkpointer.restore_state(None, target)
        state = restored.state
        assert restored.step == 1 and int(state.step) == 1
        assert [s.step for s in checkpointer.skipped] == [2]
        assert any("restored step 1" in m and "step 2" in m for m in messages), messages
        assert_follows(state, target)

        # Resuming from step 1 and saving step 2 again replaces the damaged step.
        state, _ = trainer.train_step(state, batch(trainer, 1))
        checkpointer.save(state, checkpoint_meta(trainer, step=2, data_position=2 * GLOBAL_BATCH))
        resaved = host(state)
        checkpointer.wait()
        restored = checkpointer.restore_state(None, target)
        state = restored.state
        assert checkpointer.skipped == () and restored.step == 2
    for got, want in zip(host(state), resaved, strict=True):
        np.testing.assert_array_equal(got, want)
    # Same data, same examples, same layout: the resumed run reproduces the original step 2.
    for got, want in zip(resaved, saved["state"], strict=True):
        np.testing.assert_array_equal(got, want)


@orbax_abandoned_reads
def test_read_meta_then_restore_falls_back_past_a_damaged_step(saved, tmp_path):
    """The metadata decides the target, then the restore reads the arrays: a step whose metadata
    is damaged is passed over by both, one whose arrays are damaged by the restore alone."""
    target = restore_target(saved["trainer"])
    for damage, newest_meta in (("metadata-garbage", 1), ("one-data-byte-flipped", 2)):
        directory = damaged_copy(saved, tmp_path / damage)
        DAMAGE[damage](directory)
        with Checkpointer(directory) as checkpointer:
            meta = checkpointer.read_meta()
            assert meta.step == newest_meta and meta.base is None
            restored = checkpointer.restore_state(None, target)
            assert restored.step == 1 and restored.meta == checkpointer.read_meta(1)
            assert [s.step for s in checkpointer.skipped] == [2]
    with Checkpointer(tmp_path / "metadata-garbage" / "checkpoints", read_only=True) as reader:
        with pytest.raises(CheckpointError, match=r"\(step 2\) is damaged: JSONDecodeError"):
            reader.read_meta(2)
        with pytest.raises(CheckpointError, match=r"step 3\) does not exist"):
            reader.read_meta(3)


@orbax_abandoned_reads
def test_every_step_damaged_is_an_error(saved, tmp_path):
    directory = damaged_copy(saved, tmp_path)
    for step in (1, 2):
        _garble(data_files(directory, step)[0], num_bytes=8)
    with (
        Checkpointer(directory) as checkpointer,
        pytest.raises(CheckpointError, match="no good checkpoint") as error,
    ):
        checkpointer.restore_state(None, restore_target(saved["trainer"]))
    assert "(step 1)" in str(error.value) and "(step 2)" in str(error.value)


def test_interrupted_save_is_ignored_and_cleaned_up(saved, tmp_path):
    directory = damaged_copy(saved, tmp_path)
    # What a save killed before its commit leaves: a partial step under a temporary name.
    partial = directory / "3.orbax-checkpoint-tmp-1700000000000000"
    shutil.copytree(directory / "2", partial)
    shutil.rmtree(partial / "meta")
    target = restore_target(saved["trainer"])
    # A reader (say, evaluating a running job) ignores it and leaves it alone.
    with Checkpointer(directory, read_only=True) as reader:
        assert reader.all_steps() == [1, 2]
        assert reader.restore_state(None, target).step == 2
        with pytest.raises(CheckpointError, match="read-only"):
            reader.save(tiny_state(3), tiny_meta(3))
    assert partial.exists()
    with Checkpointer(directory) as checkpointer:
        assert checkpointer.all_steps() == [1, 2]
        assert checkpointer.restore_state(None, target).step == 2 and checkpointer.skipped == ()
    assert not partial.exists()


# --- checkpoints of another model ----------------------------------------------------------------


def test_incompatible_shapes_name_the_path(saved):
    wider = make_trainer(SAVED_POLICY, 2, model=MODEL.model_copy(update={"n_embd": 48}))
    with Checkpointer(saved["directory"]) as checkpointer:
        for step in (2, None):  # no fallback: every step of this run is the other model
            with pytest.raises(IncompatibleCheckpointError) as error:
                checkpointer.restore_state(step, restore_target(wider))
            message = str(error.value)
            assert f"{saved['directory'] / '2'} (step 2)" in message
            assert (
                "params/blocks/attn_k/bias: checkpoint has (3, 40) float32, target (3, 48) float32"
                in message
            )

        # A tree that lacks a leaf of the checkpoint (and vice versa) is named too.
        target = restore_target(saved["trainer"])
        params = dict(target.params)
        params["extra"] = params.pop("wpe")
        with pytest.raises(IncompatibleCheckpointError) as error:
            checkpointer.restore_state(2, target.replace(params=params))
    assert "params/extra: in the target" in str(error.value)
    assert "params/wpe: in the checkpoint" in str(error.value)


# --- parameters alone ----------------------------------------------------------------------------


def test_params_only_restore_reads_the_params_into_another_layout(saved):
    policy, per_device, num_devices = TARGETS["tp4-8devices"]
    trainer = make_trainer(policy, per_device, num_devices)
    target = restore_target(trainer).params
    with Checkpointer(saved["directory"], read_only=True) as checkpointer:
        # Generation lays the parameters out by the saved config: metadata first, then arrays.
        assert checkpointer.read_meta().step == 2
        restored = checkpointer.restore_params(None, target)
        assert checkpointer.skipped == ()
        assert restored.meta == checkpoint_meta(
            saved["trainer"], step=2, data_position=2 * GLOBAL_BATCH
        )
        num_params = len(jax.tree.leaves(target))  # a TrainState flattens its params first
        for got, want in zip(host(restored.state), saved["state"][:num_params], strict=True):
            np.testing.assert_array_equal(got, want)
        assert_follows(restored.state, target)

        # Another model's parameters are named, and never fall back.
        wider = make_trainer(SAVED_POLICY, 2, model=MODEL.model_copy(update={"n_embd": 48}))
        with pytest.raises(IncompatibleCheckpointError) as error:
            checkpointer.restore_params(None, restore_target(wider).params)
    assert "params/blocks/attn_k/bias: checkpoint has (3, 40) float32" in str(error.value)


def _edit_metadata(directory, step, edit):
    path = directory / str(step) / "meta" / "metadata"
    payload = json.loads(path.read_text())
    edit(payload)
    path.write_text(json.dumps(payload))


def _wrong_fingerprint(payload, path="params/wpe"):
    payload["fingerprints"][path] = (payload["fingerprints"][path] + 1) % 2**32


PARAMS_DAMAGE = {
    "metadata-garbage": (DAMAGE["metadata-garbage"], "is damaged: JSONDecodeError"),
    "state-dir-deleted": (DAMAGE["state-dir-deleted"], "is damaged"),
    "format-version-unknown": (
        lambda d: _edit_metadata(d, 2, lambda p: p.update(format_version=2)),
        "format_version is 2, expected 1",
    ),
    "params-fingerprint-wrong": (
        lambda d: _edit_metadata(d, 2, _wrong_fingerprint),
        "(fingerprint mismatch): params/wpe",
    ),
}


@orbax_abandoned_reads
@pytest.mark.parametrize("damage", PARAMS_DAMAGE)
def test_params_only_restore_checks_every_step_and_falls_back(saved, tmp_path, damage):
    directory = damaged_copy(saved, tmp_path)
    damage_fn, reason = PARAMS_DAMAGE[damage]
    damage_fn(directory)
    target = restore_target(saved["trainer"]).params
    with Checkpointer(saved["directory"], read_only=True) as intact:
        step_1 = host(intact.restore_params(1, target).state)
    messages = []
    with log_lines(messages.append), Checkpointer(directory, read_only=True) as checkpointer:
        with pytest.raises(CheckpointError) as error:
            checkpointer.restore_params(2, target)
        assert f"{directory / '2'} (step 2) is damaged" in str(error.value)
        assert reason in str(error.value)
        restored = checkpointer.restore_params(None, target)
    assert restored.step == 1 and [s.step for s in checkpointer.skipped] == [2]
    assert any("restored step 1" in m and reason in m for m in messages), messages
    for got, want in zip(host(restored.state), step_1, strict=True):
        np.testing.assert_array_equal(got, want)


# --- bounded host staging ------------------------------------------------------------------------


def test_budgeted_save_and_restore_round_trip_bit_identical(tmp_path, monkeypatch):
    """A host budget of one byte (each save and restore then keeps one shard in flight: orbax's
    limit is just above the largest request, which it refuses to exceed) and fingerprints hashed
    in blocks of a few elements (rows, remainders, shards over two mesh axes): the state saved in
    one layout restores bit for bit into another, and every fingerprint equals the one hashed
    whole."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))

    def put(x, *spec):
        return jax.device_put(
            x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        )

    key = jax.random.PRNGKey(3)
    state = {
        "params": {
            "w": put(jax.random.normal(key, (2 * 13, 4 * 7)), "a", "b"),  # (26, 28)
            "e": put(jax.random.normal(key, (8 * 9, 11)).astype(jnp.bfloat16), ("b", "a"), None),
            "s": put(jnp.arange(4 * 3 * 5, dtype=jnp.int32).reshape(12, 5), None, None),
        },
        "v": put(jax.random.normal(key, (8 * 3, 1, 3)), ("a", "b")),  # rows in blocks of 2
    }
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    hashed = device_fingerprints([leaf for _, leaf in flat])  # whole, as on GPUs and TPUs
    whole = {path_str(path): int(value) for (path, _), value in zip(flat, hashed, strict=True)}
    monkeypatch.setattr(sys.modules[fingerprints.__module__], "BLOCK_ELEMENTS", 7)
    assert fingerprints(state) == whole  # on the host, in blocks of rows of each shard
    assert limit(1, write_requests(state)) < sum(x.nbytes for x in jax.tree.leaves(state))
    with Checkpointer(tmp_path / "checkpoints", host_budget_bytes=1) as checkpointer:
        checkpointer.save(state, tiny_meta(1))
        checkpointer.wait()
    other = {  # every leaf in another layout: reads span several stored chunks
        "params": {"w": P(None, "a"), "e": P("a", None), "s": P("b", None)},
        "v": P(None, None, None),
    }
    target = jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, spec)
        ),
        state,
        other,
    )
    with Checkpointer(tmp_path / "checkpoints", read_only=True, host_budget_bytes=1) as reader:
        restored = reader.restore_state(None, target).state
        params = reader.restore_params(1, target["params"]).state
    for got, want in zip(host(restored), host(state), strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(host(params), host(state["params"]), strict=True):
        np.testing.assert_array_equal(got, want)
    assert restored["params"]["w"].sharding.spec == P(None, "a")
